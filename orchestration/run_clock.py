"""`eyas run`'s clock: the one place that reads the time. It owns the budget (a deadline), the plan made from the rates
measured in the run's first seconds, every stage's deadline, and the re-plans at the stage boundaries
(orchestration/budget.py has their arithmetic)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from orchestration.budget import (
    ANSWER_TOKENS,
    EVAL_SHARE,
    Done,
    Plan,
    Rates,
    describe_seconds,
    first_shares,
    plan_run,
    replan,
    scaled,
    speed,
    stage_seconds,
)
from orchestration.machine_rate import measure_rates, rates_line


def took(job: Any) -> float:
    """Seconds a job ran: from its creation to its last update."""
    return job.updated_at - job.created_at


@dataclass
class RunClock:
    started: float  # time.monotonic() as the run began
    end: float  # time.time() by which the pipeline is done (the live check runs after it, within the budget)
    batch: int
    rates: Rates  # as the probe measured them
    plan: Plan
    max_tokens: int  # per answer: asked for, else the plan's
    eval_prompts: int  # asked for, else the plan's
    machine: Rates = field(init=False)  # the probe's rates scaled by how fast the stages so far went
    # the most evaluation's re-planned share takes: EVAL_SHARE of what is left as generation starts
    eval_cap: float = math.inf
    # the least training's re-planned share takes: the plan's first share of it, of what is left as generation starts
    train_floor: float = 0.0
    replanned: dict[str, float] = field(default_factory=dict)  # each stage's seconds in the last re-plan
    replans: list[dict[str, Any]] = field(default_factory=list)  # every re-plan, as printed (for the run's summary)

    def __post_init__(self) -> None:
        self.machine = self.rates

    @classmethod
    def measure(cls, args: Any, reserve_s: float, started: float) -> RunClock:
        """The clock of a run of `args.minutes`, `reserve_s` of them kept after the pipeline: the machine's rates
        measured now, and the plan they give for the rest."""
        minutes = args.minutes - reserve_s / 60
        end = time.time() + 60 * minutes  # every stage's deadline is a share of what is left of this
        print(f"measuring this machine for a {args.minutes:g}-minute run ...", flush=True)
        rates = measure_rates(args.target, args.batch)
        plan = plan_run(minutes, rates, args.batch, args.max_tokens or ANSWER_TOKENS,
                        spent_s=time.monotonic() - started)
        print(rates_line(rates))
        print(plan.describe())
        return cls(started, end, args.batch, rates, plan, args.max_tokens or plan.max_tokens,
                   args.eval_prompts or plan.eval_prompts)

    def left(self) -> float:
        return self.end - time.time()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def after(self, seconds: float) -> float:
        """The deadline `seconds` from now."""
        return time.time() + seconds

    def share(self, fraction: float, until: float | None = None) -> float:
        """The deadline `fraction` of the time from now to `until` (default: the pipeline's end) away."""
        now = time.time()
        return now + fraction * ((self.end if until is None else until) - now)

    def generation_deadline(self) -> float:
        """Generation's deadline, its plan's share of what is left; evaluation's cap is fixed from the same."""
        shares = first_shares(self.plan.seconds)
        self.eval_cap, self.train_floor = EVAL_SHARE * self.left(), shares["train"] * self.left()
        return self.share(shares["generate"])

    def observe(self, job: Any, predicted_s: float) -> None:
        """A stage predicted at the probe's rates to take `predicted_s` took what `job` did: the machine's speed."""
        self.machine = scaled(self.rates, speed(predicted_s, took(job)))

    def observe_generation(self, job: Any, samples: int) -> None:
        self.observe(job, stage_seconds(self.rates, samples, self.max_tokens, self.eval_prompts,
                                        self.batch)["generate"])

    def observe_extraction(self, job: Any, done: Done) -> None:
        self.observe(job, replan(1e9, self.rates, done, self.eval_prompts, self.batch, ("extract",))["extract"])

    def replan(self, after: Any, done: Done, stages: tuple[str, ...], overlap: bool = False) -> dict[str, float]:
        """Seconds for each of `stages` out of what is left, at the machine's speed so far; printed, and kept for the
        summary. `after` is the job of the stage that just ended."""
        left_s = self.left()
        left = replan(left_s, self.machine, done, self.eval_prompts, self.batch, stages, overlap=overlap,
                      eval_cap_s=self.eval_cap, train_floor_s=self.train_floor)
        self.replanned.update(left)
        ratio = self.machine.forward_tok_s / self.rates.forward_tok_s
        self.replans.append({"after": after.stage, "took_s": took(after), "conversations": done.samples,
                             "machine_ratio": ratio, "seconds": left})
        over = sum(left.values()) - left_s  # only training's floor plans past what is left
        late = f" (training keeps its planned {self.train_floor:.0f} s: the run ends about {over:.0f} s late)" \
            if over > 1 else ""
        print(f"re-plan after {after.stage} ({took(after):.0f} s, {done.samples} conversations; the machine ran "
              f"{ratio:.2f}x the probe's rates): {describe_seconds(left)}{late}", flush=True)
        return left

    def replan_evaluation(self) -> float:
        """Evaluation's seconds: all that is left."""
        self.replanned["evaluate"] = self.left()
        return self.replanned["evaluate"]

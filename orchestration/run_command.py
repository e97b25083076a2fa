"""`eyas run`: generate → extract → train → evaluate on the embedded default, with progress for each stage.

The run keeps to a time budget (`--minutes`, default 10): it measures this machine's rates in its first seconds
(orchestration/machine_rate.py) and plans each stage's share (orchestration/budget.py); each stage then works to its
deadline (generation keeps producing answers, training keeps stepping, evaluation keeps scoring prompts until
theirs), and at every stage boundary the rest is re-planned from how fast the stages actually went. It prints the
plan, each re-plan, and ends with the stage times planned, re-planned and taken. Defaults: the bundled
SmolLM2-135M-Instruct target, prompts synthesized from it, a
local directory store. Every stage runs through the same pipeline code as the services. When the planned features
do not fit the store's disk cap (`--store-gb`), extraction and training run together on a bounded window of them
(`--features-policy`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eyas.defaults import BUNDLED
from eyas.methods import DEFAULT_METHOD, METHODS
from orchestration.live_plan import LIVE_CHECK_S, LIVE_MIN_BUDGET, LIVE_TWO_CONCURRENCIES_MINUTES, LivePlan, live_plan

if TYPE_CHECKING:
    from orchestration.budget import Done
    from orchestration.run_clock import RunClock

# cache: extract everything, then train on the stored features; first_epoch / recompute: extract while a train job
# trains on the shards as they land (eyas.handoff), keeping them for later epochs / extracting each epoch again
FeaturesPolicy = Literal["cache", "first_epoch", "recompute"]
FEATURES_POLICIES = ("auto", *typing.get_args(FeaturesPolicy))  # auto: cache when the features fit the store


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=Path("eyas-work"),
                   help="everything goes under DIR (default: %(default)s)")
    p.add_argument("--target", default=BUNDLED, help="target model: HF directory or %(default)s")
    p.add_argument("--prompts", default=None,
                   help="training prompt file (default: prompts synthesized from the target itself)")
    p.add_argument("--endpoint", default=None, help="OpenAI-compatible endpoint for generation (default: in-process)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="wall-time budget: prompts and evaluation are sized to fit it here (default: %(default)s)")
    # defaults measured against alternatives on 2 cores: bench/README.md § eyas run defaults
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (default: the budget's plan)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max new tokens per answer (default: 96, shorter only when the budget is under one batch)")
    p.add_argument("--batch", type=int, default=96,
                   help="most requests generated at once (in-process: one batch; the prompts run in balanced "
                   "batches) (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=None, help="trainer steps (default: the trainer's CPU default)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="MT-bench prompts to evaluate on (default: the budget's plan, 20 at 10 minutes)")
    p.add_argument("--features-policy", choices=FEATURES_POLICIES, default="auto",
                   help="how the features reach training: cache (extract them all, then train), first_epoch (train on "
                   "the shards as they land and keep them for later epochs), recompute (extract every epoch again "
                   "while training, the store holding at most --store-gb); auto: cache when the planned features fit "
                   "--store-gb, else recompute (default: %(default)s)")
    p.add_argument("--store-gb", type=_positive, default=None,
                   help="disk for the features in the store, GiB (default: half the free space of the workdir's "
                   "filesystem)")
    p.add_argument("--method", choices=(*METHODS, "auto"), default=DEFAULT_METHOD,
                   help="the drafter: " + "; ".join(f"{m.name} ({m.summary})" for m in METHODS.values())
                   + "; or auto: all of them on the same features, each with its share of the training and "
                   "evaluation time, and the one predicted fastest at --concurrency named at the end (%(default)s "
                   "only when the features are streamed: they feed one trainer) (default: %(default)s)"),
    p.add_argument("--concurrency", type=int, default=1,
                   help="the serving concurrency --method auto chooses for (default: %(default)s)")
    p.add_argument("--live", choices=("auto", "on", "off"), default="auto",
                   help="check the serving answer on vLLM: start it serving the target plain, with the drafter and "
                   "with n-gram prompt lookup (and suffix decoding where installed), measure each on the evaluation "
                   "prompts, and answer with the fastest; the budget keeps time for it "
                   f"({LIVE_CHECK_S[(1,)]:.0f} s at concurrency 1, {LIVE_CHECK_S[(1, 4)]:.0f} s at 1 and 4 from a "
                   f"{LIVE_TWO_CONCURRENCIES_MINUTES:g}-minute budget). auto: on wherever a vLLM environment is "
                   "installed (EYAS_VLLM_PYTHON, or the checkout's .venv-vllm) and the budget is at least "
                   f"{LIVE_MIN_BUDGET} times that (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                   help="override a field of a stage's spec, e.g. train.lr=0.001, generate.sampling.temperature=0.7, "
                   "evaluate.k=4 (VALUE is JSON, else a string; repeatable; bench/ablate.py uses it)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def half_free_gb(path: Path) -> float:
    """Half the free space of the filesystem `path` is (or will be) on, in GiB."""
    path = path.resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free / 2 / (1 << 30)


def hand_off_features(extract: dict[str, Any], train: dict[str, Any], policy: FeaturesPolicy,
                      cap_gb: float) -> None:
    """A streaming policy into the specs: the extract job streams its features to the train job (its `then`, which
    then starts with it), for the train job's epochs and shuffle seed, keeping at most `cap_gb` in the store; the
    train job's cache holds two windows of half of it. `cache` changes nothing."""
    if policy == "cache":
        return
    from services.trainer.spec import Spec as TrainSpec

    extract["stream"] = {"policy": policy, "epochs": math.ceil(train["epochs"]), "seed": train.get("seed", 0),
                         "max_store_gb": cap_gb}
    # a window (half the cap) holds whole shards: shards of at most a quarter of the cap (the default where larger)
    extract.setdefault("shard_mb", max(1, min(256, int(cap_gb * 1024 / 4))))
    train["cache_gb"] = max(train.get("cache_gb", TrainSpec.model_fields["cache_gb"].default), cap_gb)


def apply_overrides(specs: dict[str, dict], overrides: list[str]) -> None:
    """STAGE.FIELD[.FIELD…]=VALUE into specs[STAGE]; an unknown stage or a malformed item is an error that names
    it (a field the stage does not have is named by the stage's own validation)."""
    for item in overrides:
        path, sep, raw = item.partition("=")
        stage, *fields = path.split(".")
        if not sep or not fields or stage not in specs:
            raise SystemExit(f"--set {item!r}: expected STAGE.FIELD=VALUE with STAGE one of {', '.join(specs)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = specs[stage]
        for f in fields[:-1]:
            node = node.setdefault(f, {})
        node[fields[-1]] = value


def run_pipeline(args: argparse.Namespace) -> int:
    """The run's phases: the budget and its plan, generation, the features' policy, extraction and training,
    evaluation, and the hand-over of the drafters and the report."""
    from eyas.settings import Settings
    from orchestration.embedded import EmbeddedRunner, command_line_settings
    from orchestration.run_clock import RunClock

    started = time.monotonic()  # the plan counts what deciding the live check and measuring took
    live = live_plan(args.live, Settings(), args.minutes, args.method)
    print(f"live check on vLLM: {'on' if live.command else 'off'} ({live.why})")
    # the live check runs after the evaluation's deadline, within the budget
    clock = RunClock.measure(args, live.reserve_s, started)
    specs = RunSpecs.for_run(args, clock, live)
    settings = command_line_settings("generate", specs.generate, args.workdir)
    run = _Pipeline(args, clock, specs, EmbeddedRunner(settings.model_copy(
        update={"vllm_command": live.command, "live_check": "auto" if live.command else "off"})))
    generated = run.generate()
    if generated is None:
        return run.unfinished()
    drafters = run.extract_and_train(generated, _features(args, clock, specs, generated))
    if drafters is None:
        return run.unfinished()
    return run.hand_over(drafters, run.evaluate(drafters))


@dataclass(frozen=True)
class RunSpecs:
    """The stage specs a run's jobs start from, the --set overrides in; each phase adds its input and deadline to a
    copy. Extract, train and evaluate are `then` entries (they name their stage)."""
    generate: dict[str, Any]
    extract: dict[str, Any]
    train: dict[str, Any]
    evaluate: dict[str, Any]

    @classmethod
    def for_run(cls, args: argparse.Namespace, clock: RunClock, live: LivePlan) -> RunSpecs:
        from orchestration.budget import DECODE_PROMPTS, MAX_EPOCHS, batches
        from services.trainer.spec import CPU_PRESET

        # At most this many prompts: without --num-prompts the generation deadline decides how many there are (the
        # plan's count is a forecast from the first seconds). At least 8 batches: a probe that read a hogged machine
        # far too slow planned a handful of prompts, and a cap of 2 batches stopped generation with a third of its
        # share left (bench/README.md § Measured defaults)
        most = args.num_prompts or max(4 * clock.plan.num_prompts, 8 * args.batch)
        specs = {
            "generate": {
                **({"prompts": args.prompts, "limit": most} if args.prompts else {"synthesize": most}),
                "endpoint": args.endpoint, "target": args.target, "max_turns": 1,
                "concurrency": args.batch if args.endpoint else max(batches(most, args.batch)),
                "sampling": {"max_tokens": clock.max_tokens, "temperature": 0.0},
            },
            "extract": {"stage": "extract", "target": args.target},
            "train": {"stage": "train", "target": args.target, **CPU_PRESET, "epochs": MAX_EPOCHS,
                      **({"steps": args.train_steps} if args.train_steps else {})},
            "evaluate": {"stage": "evaluate", "target": args.target, "num_prompts": args.eval_prompts or 80,
                         "min_prompts": min(clock.eval_prompts, 16), "decode_prompts": DECODE_PROMPTS,
                         "live_concurrencies": list(live.concurrencies)},
        }
        apply_overrides(specs, args.overrides)
        return cls(**specs)


@dataclass(frozen=True)
class Features:
    """How the generated data reaches training: what generation produced, the features' policy and the store's cap
    on them, and the drafters they feed."""
    done: Done
    policy: FeaturesPolicy
    cap_gb: float
    methods: tuple[str, ...]

    @property
    def streamed(self) -> bool:
        return self.policy != "cache"


def _features(args: argparse.Namespace, clock: RunClock, specs: RunSpecs, generated: Any) -> Features:
    """The features' policy from their planned size against the store's cap (printed, with why), and the drafters
    to train; the clock learns the machine's speed from generation."""
    from eyas.layout import BF16, default_aux_layers
    from eyas.target import resolve_target
    from orchestration.budget import PROMPT_TOKENS, Done, features_gb, features_policy

    samples = generated.metrics["completed"]
    done = Done(samples, samples * PROMPT_TOKENS + generated.metrics["completion_tokens"])
    clock.observe_generation(generated, samples)
    config = json.loads((resolve_target(args.target) / "config.json").read_text())
    extract = specs.extract
    n_aux = len(extract.get("aux_layers") or default_aux_layers(config["num_hidden_layers"]))
    cap_gb = args.store_gb or half_free_gb(args.workdir)
    planned_gb = features_gb(samples, clock.max_tokens, config["hidden_size"], n_aux,
                             extract.get("features_dtype", BF16))
    policy, why = features_policy(args.features_policy, planned_gb, cap_gb)
    print(f"features: {policy}: {why}")
    streamed = policy != "cache"
    methods = (tuple(METHODS) if not streamed else (DEFAULT_METHOD,)) if args.method == "auto" else (args.method,)
    if args.method == "auto" and streamed:
        print(f"--method auto: the features are streamed into one trainer: training {DEFAULT_METHOD} only")
    return Features(done, policy, cap_gb, methods)


@dataclass
class _Pipeline:
    """A run's jobs, phase by phase, each to the deadline its clock gives it."""
    args: argparse.Namespace
    clock: RunClock
    specs: RunSpecs
    runner: Any  # orchestration.embedded.EmbeddedRunner
    jobs: list = field(default_factory=list)

    def _run(self, stage: str, spec: dict[str, Any]) -> Any:
        """Run a job (and its `then` stages); the last of them."""
        self.jobs += self.runner.run_job(stage, spec)
        return self.jobs[-1]

    def generate(self) -> Any | None:
        """Generation in its share of what is left (synthesized prompts come a batch at a time, each answered before
        the next is drawn: services/generator/gather.py): its job, or None when it failed or answered nothing."""
        finish_by = self.clock.generation_deadline()
        generated = self._run("generate", {**self.specs.generate, "finish_by": finish_by})
        if generated.state != "succeeded":
            return None
        if not generated.metrics["completed"]:  # nothing to extract or train on: stop here, saying why
            print(f"generation answered no prompt in its {finish_by - generated.created_at:.0f} s share: this "
                  "machine ran slower than its first seconds promised; give the run more minutes (--minutes)")
            return None
        return generated

    def extract_and_train(self, generated: Any, data: Features) -> list | None:
        """Extraction, and training beside it (streamed) or after it: the train jobs, or None when one failed."""
        from orchestration.budget import MAX_EPOCHS, train_steps, val_interval
        from services.trainer.spec import CPU_PRESET

        clock = self.clock
        left = clock.replan(generated, data.done, ("extract", "train", "evaluate"), overlap=data.streamed)
        steps = train_steps(data.done.samples, clock.max_tokens, MAX_EPOCHS, self.args.train_steps)
        steps_fit = max(1, round(left["train"] * clock.machine.train_tok_s / CPU_PRESET["batch_tokens"]))
        extract = {**self.specs.extract, get_input("extract"): generated.artifacts["output"]}
        train = {**self.specs.train, "val_interval": val_interval(min(steps, steps_fit))}
        hand_off_features(extract, train, data.policy, data.cap_gb)
        if data.streamed:
            then = {**train, "finish_by": clock.after(left["train"]), "method": data.methods[0]}
            self._run("extract", {**_job(extract), "then": [then]})
        elif not self._train_after_extraction(extract, train, data):
            return None
        drafters = [j for j in self.jobs if j.stage == "train"]
        return drafters if drafters and drafters[-1].state == "succeeded" else None

    def _train_after_extraction(self, extract: dict[str, Any], train: dict[str, Any], data: Features) -> bool:
        """Extraction, then each drafter trained in its share of the training time re-planned after it."""
        extracted = self._run("extract", _job(extract))
        if extracted.state != "succeeded":
            return False
        self.clock.observe_extraction(extracted, data.done)
        left = self.clock.replan(extracted, data.done, ("train", "evaluate"))
        train = {**train, get_input("train"): extracted.artifacts["output"]}
        train_end = self.clock.after(left["train"])
        for i, method in enumerate(data.methods):
            finish_by = self.clock.share(1 / (len(data.methods) - i), until=train_end)
            if self._run("train", _job({**train, "finish_by": finish_by, "method": method})).state != "succeeded":
                return False
        return True

    def evaluate(self, drafters: list) -> list:
        """Each drafter evaluated in its share of what is left, the last report comparing them: the reports made."""
        from services.extractor.vllm_backend import release_engine

        release_engine()  # extraction is over: the capture engine's memory goes back before the live check's servers
        seconds = self.clock.replan_evaluation()
        print(f"re-plan after train: evaluate {seconds:.0f} s (at least {self.specs.evaluate['min_prompts']} prompts"
              f"{' each' if len(drafters) > 1 else ''})")
        reports: list = []
        for i, trained in enumerate(drafters):
            spec = {**self.specs.evaluate, "finish_by": self.clock.share(1 / (len(drafters) - i)),
                    get_input("evaluate"): trained.artifacts["output"],
                    "compare_with": [r.artifacts["output"] for r in reports]}
            if self._run("evaluate", _job(spec)).state != "succeeded":
                break
            reports.append(self.jobs[-1])
        return reports

    def hand_over(self, drafters: list, reports: list) -> int:
        """The summary and the drafters' exports, whatever the evaluation concluded; then the report's answer."""
        print()
        self._summary()
        for trained in drafters:
            print(f"drafter exports, {trained.spec.get('method', DEFAULT_METHOD)} (README: \"Serve the drafter\"):")
            for name, uri in sorted(trained.artifacts.items()):
                if name != "output":
                    print(f"  {name}: {uri}")
        report = self.jobs[-1]
        finished = report.stage == "evaluate" and report.state == "succeeded"
        choice = _method_choice(report) if finished and len(reports) > 1 else None
        self._write_summary(finished, drafters, report if finished else None, choice)
        if not finished:
            print("pipeline did not finish; see the job records above")
            return 1
        print(f"\nacceptance length τ = {report.metrics.get('acceptance_length')}  "
              f"(K = {report.metrics.get('k')}, {report.metrics.get('prompts')} MT-bench prompts; in "
              f"{self.clock.elapsed():.0f} s of a {self.args.minutes:g}-minute budget)")
        for name, uri in sorted(report.artifacts.items()):
            print(f"  {name}: {uri}")
        if report.metrics.get("serving_decision"):
            print(f"\n{report.metrics['serving_decision']}")
        if choice is not None:
            print(_describe_choice(choice, self.args.concurrency))
        return 0

    def unfinished(self) -> int:
        print()
        self._summary()
        self._write_summary(False, [], None, None)
        print("pipeline did not finish; see the job records above")
        return 1

    def _write_summary(self, finished: bool, drafters: list, report: Any, choice: dict | None) -> None:
        """What the terminal shows, as data: `run.json` in the workdir (the plan, the re-plans, each job, the
        exports, the report's figures and the method comparison), for scripts and tests to read."""

        clock = self.clock
        summary = {
            "finished": finished, "minutes": self.args.minutes, "elapsed_s": clock.elapsed(),
            "rates": dataclasses.asdict(clock.rates), "plan": dataclasses.asdict(clock.plan),
            "replans": clock.replans,
            "jobs": self._job_rows(),
            "exports": {t.spec.get("method", DEFAULT_METHOD): {k: v for k, v in t.artifacts.items() if k != "output"}
                        for t in drafters},
            "report": None if report is None else {"metrics": report.metrics, "artifacts": report.artifacts},
            "method_choice": choice,
        }
        path = self.runner.settings.workdir / "run.json"
        path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        print(f"summary: {path}")

    def _job_rows(self) -> list[dict[str, Any]]:
        """Each job's state and seconds beside the plan's and the last re-plan's (each job is created when the one
        before it ends, a streamed train job when extraction starts, and last updated when it ends)."""
        from orchestration.run_clock import took

        return [{"stage": j.stage, "state": j.state, "planned_s": self.clock.plan.seconds.get(j.stage),
                 "replanned_s": self.clock.replanned.get(j.stage), "took_s": took(j), "error": j.error,
                 "output": j.artifacts.get("output"), "metrics": j.metrics} for j in self.jobs]

    def _summary(self) -> None:
        """The jobs' table (_job_rows) as the terminal shows it."""
        print(f"  {'stage':<9} {'state':<10} {'planned':>8} {'re-planned':>11} {'took':>7}")
        for row in self._job_rows():
            again = row["replanned_s"]
            print(f"  {row['stage']:<9} {row['state']:<10} {row['planned_s'] or 0:7.0f}s "
                  f"{'—' if again is None else f'{again:.0f}s':>11} {row['took_s']:6.0f}s  {row['output'] or ''}")


def _method_choice(report) -> dict:
    """The last report's comparison of the methods (its `serving.methods`: each method's best per concurrency, and
    the pick at each)."""
    from eyas.store import open_artifact

    return json.loads(open_artifact(report.artifacts["output"]).get_bytes("report.json"))["serving"]["methods"]


def _describe_choice(methods: dict, concurrency: int) -> str:
    """The method the comparison predicts fastest at the concurrency nearest `concurrency`."""
    pick = min(methods["choice"], key=lambda c: abs(c["concurrency"] - concurrency))
    table = "; ".join(f"{m['method']} " + ", ".join(
        f"{b['speedup']:.2f} × (K = {b['k']}) at {b['concurrency']}" if b["k"] is not None
        else f"not measured at {b['concurrency']}" for b in m["best"]) for m in methods["methods"])
    if pick["method"] is None:
        return (f"methods (predicted speed-up): {table}\nat concurrency {pick['concurrency']}: no method's "
                "acceptance was measured")
    return (f"methods (predicted speed-up): {table}\nat concurrency {pick['concurrency']}: serve {pick['method']} "
            f"({pick['speedup']:.2f} ×, K = {pick['k']}): {pick['drafter']}")


def _job(entry: dict) -> dict:
    """A `then` entry ({"stage": name, ...fields}) as a job's own spec."""
    return {k: v for k, v in entry.items() if k != "stage"}


def get_input(stage: str) -> str:
    """The spec field a stage reads its input artifact from."""
    from orchestration.registry import get_stage

    return get_stage(stage).input_field

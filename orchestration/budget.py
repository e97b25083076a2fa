"""`eyas run --minutes N`: the budget's arithmetic. A budget is a deadline; a plan is a forecast.

From the rates orchestration/machine_rate.py measures in the run's first seconds, `plan_run` sizes the prompts, the
evaluation prompts and, for budgets too small for one batch, the answer length, so that the whole run fits with
MAX_EPOCHS epochs of training. That plan only sets each stage's first share of the budget: every
stage then works to a deadline (its spec's `finish_by`) and stops at its own boundary, and at every stage boundary
`replan` divides what is left among the stages still to run, from the rates scaled by how fast the stages so far
actually went (`speed`). What one prompt costs in tokens (the constants below) was measured on the bundled
target; bench/README.md § Planner costs has the plans against the times they took. The planned features,
against the store's disk cap, decide how they reach training (`features_policy`): cached whole, or streamed to a
train job running beside extraction. The stages' own defaults (epochs, validation split, evaluation lengths) are
read from their specs.
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.features import shard_bytes, token_bytes
from eyas.layout import BF16
from services.evaluator.spec import Spec as EvalSpec
from services.evaluator.steptime import STEP_TIMES_S
from services.trainer.data import total_steps
from services.trainer.spec import CPU_PRESET
from services.trainer.spec import Spec as TrainSpec

if TYPE_CHECKING:
    from orchestration.run_command import FeaturesPolicy

# What one prompt costs in tokens on the bundled target (SmolLM2-135M-Instruct, synthesized prompts), measured
# from `eyas run` job records: bench/README.md § Planner costs.
SYNTH_DRAWS = 1.24  # candidate requests drawn per kept prompt (the rest lack an end of turn or repeat)
# Generation's cost in steps of the rate probe (16 tokens for short requests, at the batch and at half of it;
# `decode_step_s`): a batch runs to its longest row, and prompts' prefill and a growing KV cache make each step
# dearer than the probe's. Fitted to a `make run`'s synthesis and answer times against its probe (task-mix
# synthesis; bench/README.md § Planner costs).
SYNTH_TOKENS = 100  # per candidate request (sampled up to 128 tokens)
ANSWER_STEP_COST = 1.2  # per `max_tokens` of an answer
ANSWER_FILL = 0.85  # answer tokens per `max_tokens` (most answers run to the cap): what extraction and training see
PROMPT_TOKENS = 60  # rendered prompt (template + request) tokens
# max_tokens per answer: more, shorter answers teach more (bench/README.md § Levers at equal wall time)
ANSWER_TOKENS = 96
EVAL_NEW_TOKENS = EvalSpec.model_fields["max_new_tokens"].default
SECOND_SET_PROMPTS = EvalSpec.model_fields["second_num_prompts"].default  # the evaluator's second held-out set
# The evaluator's greedy outputs run in batches of 32 with transformers' `generate` (services/evaluator/specdec.py:
# greedy), dearer per token than generation's own decoding, and each prompt then has one teacher-forced forward
# (the replay). Fitted to the same `make run`'s evaluation time (bench/README.md § Planner costs).
EVAL_GREEDY_COST = 3.5  # seconds per evaluation token, in units of 1 / decode_tok_s
DECODE_PROMPTS = 1  # prompts the evaluator also decodes speculatively in-process (the replay's check)
DECODE_STEP_COST = 1.2  # seconds per token of that decoding, in target steps (a verify forward per round + drafts)
FIXED_S = 45.0  # model loads, synthesis's first batch, artifact writes, teacher-forced accuracy: all stages
# Prompts are sized so that training has time for this many epochs over them, the most it runs (6 epochs beat 3:
# bench/README.md § Recipes at fixed data). Sized at 3 epochs, a quiet run whose decoding outran its probe
# generated more prompts than it then had time to train on, and scored below a run slowed in generation by a hog:
# generation's share is set before its speed is known, and a larger training share keeps the epochs near 3 when
# generation outruns the plan (bench/README.md § Measured defaults).
MAX_EPOCHS = 6.0
TRAIN_SHARE = 1 - 1 / TrainSpec.model_fields["val_every"].default  # of the samples (the rest validate)
# Validations `eyas run` asks of the trainer, about (the first, at step 0, and the last included): enough points for
# the report's curve. At the trainer's default interval (every 100 steps) a 60-minute run validated twice as often,
# a sixth of its training time that the plan did not have (bench/README.md § Planner costs).
VAL_PASSES = 10
# The most of the budget evaluation's first share may take. Its cost is a count of prompts, whatever the data: a
# probe that read a busy machine several times slow would otherwise give it half of a 10-minute budget, and
# generation, where τ is bought, a third. Quiet, it takes less; under a deadline the evaluator scores what its share
# allows.
EVAL_SHARE = 0.2


@dataclass(frozen=True)
class Rates:
    decode_tok_s: float  # at the run's batch
    decode_half_tok_s: float  # at half of it
    forward_tok_s: float
    train_tok_s: float
    val_tok_s: float
    step_s: float


@dataclass(frozen=True)
class Plan:
    minutes: float
    num_prompts: int
    max_tokens: int
    eval_prompts: int
    seconds: dict[str, float]  # predicted, per stage

    def describe(self) -> str:
        stages = describe_seconds(self.seconds)
        return (f"plan for {self.minutes:g} min: {self.num_prompts} prompts × {self.max_tokens} tokens, "
                f"{MAX_EPOCHS:g} epochs, {self.eval_prompts} MT-bench prompts to evaluate; predicted {stages} "
                f"(total {sum(self.seconds.values()):.0f} s)")


def eval_prompts_for(minutes: float) -> int:
    """More prompts for longer runs: τ's spread over prompts shrinks as 1/√n (20 at 10 min, 70 at 60; MT-bench has
    80). Each costs its greedy output and one forward (the replay)."""
    return max(4, min(80, round(20 + (minutes - 10))))


def batches(prompts: int, batch: int) -> list[int]:
    """Rows of each in-process batch: the fewest batches of at most `batch`, balanced (a part batch would cost
    nearly a whole one's steps)."""
    k = -(-prompts // batch)
    return [prompts // k + (i < prompts % k) for i in range(k)] if prompts else []


def decode_step_s(rates: Rates, rows: int, batch: int) -> float:
    """Seconds of one decoding step of `rows` sequences: linear between the two measured batches (a step has a
    fixed cost, streaming the weights, and one per row)."""
    half = max(1, batch // 2)
    full_s, half_s = batch / rates.decode_tok_s, half / rates.decode_half_tok_s
    per_row = (full_s - half_s) / max(1, batch - half)
    return max(half_s + per_row * (rows - half), full_s * rows / batch)


def sample_tokens(max_tokens: int) -> float:
    """Tokens of one conversation as extraction and training see it: the rendered prompt and its answer."""
    return PROMPT_TOKENS + ANSWER_FILL * max_tokens


def features_gb(prompts: int, max_tokens: int, hidden: int, n_aux: int, dtype: str = BF16) -> float:
    """The planned features in GiB: the prompts' tokens as extraction sees them, each taking what a shard stores of
    it (n_aux aux layers and the final one, `hidden` values each in `dtype`, the extract job's features_dtype;
    its id and loss mask)."""
    row = token_bytes((n_aux + 1) * hidden, n_aux + 1, dtype)
    return shard_bytes(round(prompts * sample_tokens(max_tokens)), row) / (1 << 30)


def features_policy(asked: str, planned_gb: float, cap_gb: float) -> tuple[FeaturesPolicy, str]:
    """How the features reach training, and why. A policy asked for wins; auto caches them when they fit the
    store's cap, else recomputes them every epoch while training (the store then holds at most the cap)."""
    sizes = f"planned features {planned_gb:.2f} GB, store cap {cap_gb:.2f} GB"
    if asked != "auto":
        return typing.cast("FeaturesPolicy", asked), f"asked for ({sizes})"
    if planned_gb <= cap_gb:
        return "cache", f"the features fit the store ({sizes})"
    return "recompute", f"the features do not fit the store ({sizes})"


def train_steps(prompts: int, max_tokens: int, epochs: float, steps: int | None = None) -> int:
    """The trainer's optimizer steps (services.trainer.data.total_steps), for train samples of the planned length;
    `steps`, when given, as the trainer takes it."""
    lengths = [round(sample_tokens(max_tokens))] * max(1, round(TRAIN_SHARE * prompts))
    return total_steps(lengths, CPU_PRESET["batch_tokens"], seed=0, epochs=epochs, steps=steps)


def val_interval(steps: int) -> int:
    """Steps between the trainer's validations for about VAL_PASSES of them, never more often than its default."""
    return max(TrainSpec.model_fields["val_interval"].default, math.ceil(steps / (VAL_PASSES - 1)))


def val_passes(steps: int) -> int:
    """The trainer's validations at that interval: at step 0, every interval, and at the end."""
    return 1 + math.ceil(steps / val_interval(steps))


def stage_seconds(rates: Rates, prompts: int, max_tokens: int, eval_prompts: int, batch: int,
                  epochs: float = MAX_EPOCHS) -> dict[str, float]:
    """Predicted seconds per stage; model loads and writes are spread over the stages by FIXED_S / 4."""
    tokens = prompts * sample_tokens(max_tokens)
    fixed = FIXED_S / 4
    steps = SYNTH_DRAWS * SYNTH_TOKENS + ANSWER_STEP_COST * max_tokens  # per prompt, in the probe's steps
    validations = val_passes(train_steps(prompts, max_tokens, epochs))
    return {
        "generate": fixed + steps * sum(decode_step_s(rates, rows, batch) for rows in batches(prompts, batch)),
        "extract": fixed + tokens / rates.forward_tok_s,
        "train": fixed + epochs * TRAIN_SHARE * tokens / rates.train_tok_s
        + validations * (1 - TRAIN_SHARE) * tokens / rates.val_tok_s,
        "evaluate": fixed + STEP_TIMES_S + DECODE_PROMPTS * EVAL_NEW_TOKENS * DECODE_STEP_COST * rates.step_s
        + (eval_prompts + SECOND_SET_PROMPTS) * (EVAL_NEW_TOKENS * EVAL_GREEDY_COST / rates.decode_tok_s
                                                 + (PROMPT_TOKENS + EVAL_NEW_TOKENS) / rates.forward_tok_s),
    }


def plan_run(minutes: float, rates: Rates, batch: int, max_tokens: int = ANSWER_TOKENS,
             spent_s: float = 0.0) -> Plan:
    """The most prompts (a multiple of 8) whose stages fit the budget less `spent_s` (measuring) at MAX_EPOCHS; when
    not one batch fits, shorter answers first, down to a floor that still trains something."""
    budget = minutes * 60 - spent_s
    n_eval = eval_prompts_for(minutes)

    def fits(prompts: int, tokens: int) -> bool:
        return sum(stage_seconds(rates, prompts, tokens, n_eval, batch).values()) <= budget

    while max_tokens > 64 and not fits(batch, max_tokens):
        max_tokens -= 16
    prompts = 8
    while fits(prompts + 8, max_tokens):
        prompts += 8
    return Plan(minutes, prompts, max_tokens, n_eval, stage_seconds(rates, prompts, max_tokens, n_eval, batch))


def scaled(rates: Rates, speed: float) -> Rates:
    """The rates of a machine `speed` times as fast as the probe read it (busier: below 1)."""
    return Rates(decode_tok_s=rates.decode_tok_s * speed, decode_half_tok_s=rates.decode_half_tok_s * speed,
                 forward_tok_s=rates.forward_tok_s * speed, train_tok_s=rates.train_tok_s * speed,
                 val_tok_s=rates.val_tok_s * speed, step_s=rates.step_s / speed)


def speed(predicted_s: float, took_s: float) -> float:
    """How much faster than the probe's rates a stage went (its predicted seconds for what it did over the seconds
    it took), within 1/8 and 8: one stage's reading, not a verdict on the machine."""
    return min(8.0, max(1 / 8, predicted_s / max(took_s, 1e-3)))


@dataclass(frozen=True)
class Done:
    """What the stages so far produced: `samples` conversations, `tokens` in them as extraction and training see
    them (rendered prompts and answers)."""
    samples: int
    tokens: float


def first_shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each stage's share of the budget from a plan's predicted seconds, evaluation's at most EVAL_SHARE (the rest
    in the plan's proportions)."""
    total = sum(seconds.values())
    shares = {stage: s / total for stage, s in seconds.items()}
    if shares["evaluate"] > EVAL_SHARE:
        rest = 1 - shares["evaluate"]
        shares = {stage: EVAL_SHARE if stage == "evaluate" else s * (1 - EVAL_SHARE) / rest
                  for stage, s in shares.items()}
    return shares


def replan(left_s: float, rates: Rates, done: Done, eval_prompts: int, batch: int, stages: tuple[str, ...],
           overlap: bool = False, eval_cap_s: float = math.inf, train_floor_s: float = 0.0) -> dict[str, float]:
    """Seconds for each of `stages` (those still to run, of extract, train, evaluate) out of the `left_s` seconds
    left: extraction and evaluation as the (re-scaled) rates predict them for the data there is (evaluation at most
    `eval_cap_s`), training the rest, at least a tenth of what is left and at least `train_floor_s`; the others
    shrink to fit what training leaves. Only training's floor may plan past the budget: the drafter is what the run
    is for, and a stage that ran long must not leave it a step or two
    (bench/README.md § A budget on a busy machine). `overlap`: extraction runs beside training (a streamed policy),
    so it takes no time of its own."""
    fixed = FIXED_S / 4
    predicted = {
        "extract": 0.0 if overlap else fixed + done.tokens / rates.forward_tok_s,
        "evaluate": min(eval_cap_s, stage_seconds(rates, 0, ANSWER_TOKENS, eval_prompts, batch)["evaluate"]),
    }
    out = {s: predicted[s] for s in stages if s in predicted}
    train = max(train_floor_s, 0.1 * left_s, left_s - sum(out.values())) if "train" in stages else 0.0
    scale = min(1.0, max(0.0, left_s - train) / max(sum(out.values()), 1e-9))
    out = {s: v * scale for s, v in out.items()}
    if "train" in stages:
        out["train"] = train
    return {s: out[s] for s in stages if s in out}


def describe_seconds(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())

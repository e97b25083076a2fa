"""Whether and how `eyas run` checks its serving answer live on vLLM (--live): the command the evaluator starts vLLM
with, the concurrencies it measures at and the seconds the budget keeps for it. Light to import: the CLI's --help
quotes these numbers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eyas.settings import Settings

# Seconds `eyas run` keeps after the evaluation's deadline for the live check, by the concurrencies it runs at: four
# vLLM starts (plain, the drafter, n-gram prompt lookup, suffix decoding, which fails in ~20 s where not installed),
# the step times on the plain and the speculative server, and runs of services.evaluator.serving.LIVE_PROMPTS
# prompts at each concurrency: bench/README.md § Serving prediction.
LIVE_CHECK_S = {(1,): 200.0, (1, 4): 300.0}
# From this budget (minutes) the live check runs at two concurrencies; below it at concurrency 1 only
LIVE_TWO_CONCURRENCIES_MINUTES = 20.0
# The least budget, in the live check's reserve, at which `--live auto` turns it on: the pipeline keeps at least the
# rest (at 10 minutes and concurrency 1: 400 s)
LIVE_MIN_BUDGET = 3


@dataclass(frozen=True)
class LivePlan:
    """The live check `eyas run` asks of the evaluator: the command it starts vLLM with (Settings.vllm_command;
    None: no check), the concurrencies it measures at, the seconds the budget keeps for it, and why."""
    command: str | None
    concurrencies: tuple[int, ...]
    reserve_s: float
    why: str


def live_plan(live: str, settings: Settings, minutes: float, method: str) -> LivePlan:
    """Whether and how `eyas run` checks its answer on vLLM. auto: on wherever a vLLM environment is installed and
    the budget keeps LIVE_MIN_BUDGET times the check's reserve, at concurrency 1 below
    LIVE_TWO_CONCURRENCIES_MINUTES and at 1 and 4 from there; the command is the evaluator's own choice
    (services.evaluator.launch.serving_command: the operator's, else the vLLM environment's OpenAI server), whatever
    EYAS_LIVE_CHECK says: --live decides here."""
    concurrencies = (1, 4) if minutes >= LIVE_TWO_CONCURRENCIES_MINUTES else (1,)
    reserve = LIVE_CHECK_S[concurrencies]

    def off(why: str) -> LivePlan:
        return LivePlan(None, concurrencies, 0.0, why)

    if live == "off":
        return off("--live off")
    if method == "auto":  # each drafter its own vLLM starts: more than a budget keeps
        return off("--method auto compares the drafters by prediction; check the chosen one with --method M")
    python = settings.vllm_python
    if not settings.vllm_command and (python is None or not python.exists()):
        if live == "on":
            raise SystemExit(f"--live on: no vLLM environment (EYAS_VLLM_PYTHON={python}): run "
                             "scripts/install-vllm.sh, or set EYAS_VLLM_COMMAND")
        return off("no vLLM environment installed (scripts/install-vllm.sh)")
    if live == "auto" and 60 * minutes < LIVE_MIN_BUDGET * reserve:
        # the pipeline would keep less than the data τ is bought with
        return off(f"a {minutes:g}-minute budget: auto needs {LIVE_MIN_BUDGET * reserve / 60:g} minutes; --live on "
                   f"forces it, keeping {reserve:.0f} s")
    from services.evaluator.launch import serving_command  # not at --help

    at = f"at concurrency {' and '.join(map(str, concurrencies))}, {reserve:.0f} s kept for it"
    command = serving_command(settings.model_copy(update={"live_check": "auto"}))
    return LivePlan(command, concurrencies, reserve,
                    f"EYAS_VLLM_COMMAND, {at}" if settings.vllm_command else f"vLLM from {python}, {at}")

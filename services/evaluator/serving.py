"""Will this drafter speed up serving, at which concurrency, with how many draft tokens? The report's "serving" key.

  1. acceptance  τ(K) for K = 1..K_MAX from one teacher-forced pass per prompt (services.evaluator.chains; the
                 evaluator computes it once for its headline τ and passes it here)
  2. step times  the target's on the serving engine (a vLLM endpoint) or in-process, the drafter's in-process
                 (services.evaluator.steptime)
  3. prediction  tokens/s with and without speculation per (concurrency, K), best K, break-even, the decision
                 line (services.evaluator.costmodel)
  3b. methods    with earlier reports of other drafters for the same target (compare_with: e.g. EAGLE-3 beside
                 P-EAGLE), each one's best K and predicted speed-up per concurrency from its own τ(K) and draft cost
                 under this engine's target step times, and which method wins at each concurrency
  4. live check  the A/B on vLLM without and with the drafter at two concurrencies, at the K the speculative server
                 runs (its /metrics: draft tokens / drafts): predicted vs measured speed-up in the steady state the
                 model predicts (streams decoding together, steptime.endpoint_decode_rate), and end to end (live_ab:
                 wall time of the prompts, prefills and a partly filled last batch included, which pull it toward 1)
"""
from __future__ import annotations

from collections.abc import Callable

from services.evaluator import costmodel, steptime
from services.evaluator.live import live_ab
from services.evaluator.specdec import PromptIds

K_MAX = 7
LIVE_CONCURRENCIES = (1, 4)
# in-process target points: one forward over n new tokens (b = min(n, 64) sequences of n / b tokens)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def measure_steps(target, drafter, method: str, prompt: list[int], endpoint: str | None,
                  api_key: str | None, check: Callable[[], None]) -> tuple[costmodel.StepTimes, dict]:
    """Step times on the endpoint when given (else the target in-process) and the drafter's in-process; `method`,
    the drafter's (a parallel drafter drafts K tokens in one forward); `check()` (a cancel) between the points."""
    drafter_points = steptime.drafter_step_times(drafter, check=check)
    check()
    if endpoint:
        target_points = steptime.endpoint_step_times(endpoint, prompt, api_key=api_key)
        source = {"target": f"vLLM endpoint {endpoint}: decode step at batch b (streamed, ignore_eos)"}
    else:
        target_points = steptime.target_step_times(target, TOKENS, check=check)
        source = {"target": f"in-process forward over n tokens after {steptime.CONTEXT} cached ({target.name})"}
    source["drafter"] = "in-process draft step at batch b on this machine (not inside the engine)"
    times = costmodel.StepTimes(target=target_points, drafter=drafter_points,
                                parallel=costmodel.drafts_in_one_forward(method))
    return times, {"source": source, "target_s": target_points, "drafter_s": drafter_points}


def predict(times: costmodel.StepTimes, per_k: dict[int, dict], model: str, method: str) -> dict:
    """The recommendation, the exact --speculative-config for its K (model: where the server reads the export),
    and the decision line."""
    rec = costmodel.recommend(times, {k: a["acceptance_length"] for k, a in per_k.items()})
    k = rec["best"][0]["k"]
    rec["speculative_config"] = costmodel.speculative_config(model, k, method)
    rec["decision"] = costmodel.decision(rec)
    rec["per_position_acceptance_per_k"] = {str(k): a["per_position_acceptance"] for k, a in per_k.items()}
    return rec


def compare_methods(target_points: list[tuple[int, float]], drafters: list[dict]) -> dict:
    """drafters: [{"method", "drafter" (URI), "tau_per_k" (K → τ), "drafter_s" (its step times)}] →
    per drafter its best K and speed-up at each concurrency (this engine's target step times, its own draft cost),
    and per concurrency the drafter predicted fastest."""
    rows = []
    for d in drafters:
        times = costmodel.StepTimes(target=target_points, drafter=d["drafter_s"],
                                    parallel=costmodel.drafts_in_one_forward(d["method"]))
        rec = costmodel.recommend(times, {int(k): t for k, t in d["tau_per_k"].items()})
        rows.append({"method": d["method"], "drafter": d["drafter"], "best": rec["best"]})
    choice = []
    for i, c in enumerate(costmodel.CONCURRENCIES):
        top = max(rows, key=lambda r: r["best"][i]["speedup"])
        best = top["best"][i]
        choice.append({"concurrency": c, "method": top["method"], "drafter": top["drafter"], "k": best["k"],
                       "speedup": best["speedup"]})
    return {"methods": rows, "choice": choice}


def live_check(prompts: list[PromptIds], max_tokens: int, endpoint: str, spec_endpoint: str,
               times: costmodel.StepTimes, per_k: dict[int, dict], api_key: str | None, check: Callable[[], None],
               concurrencies: tuple[int, ...] = LIVE_CONCURRENCIES) -> list[dict]:
    """The A/B at each concurrency, with the prediction for the K the speculative server runs; `check()` (a
    cancel) before each of its runs."""
    out = []
    ids = [p.ids for p in prompts]
    for c in concurrencies:
        check()
        ab = live_ab(prompts, max_tokens, endpoint, spec_endpoint, c, api_key=api_key)
        spec = ab["speculative"]
        k = round(spec["draft_tokens"] / spec["drafts"])
        predicted = times.spec_tok_s(c, k, per_k[k]["acceptance_length"]) / times.plain_tok_s(c)
        check()
        plain_rate, spec_rate = (steptime.endpoint_decode_rate(url, ids, c, max_tokens, api_key)
                                 for url in (endpoint, spec_endpoint))
        measured = spec_rate / plain_rate
        out.append({"concurrency": c, "k": k, "predicted_speedup": predicted, "measured_speedup": measured,
                    "relative_error": (predicted - measured) / measured, "decode_tok_s": [plain_rate, spec_rate],
                    "measured_end_to_end_speedup": ab["speedup"],
                    "baseline_tok_s": ab["baseline"]["tok_s"], "speculative_tok_s": spec["tok_s"],
                    "tau_in_process": per_k[k]["acceptance_length"], "tau_vllm": spec["acceptance_length"],
                    "outputs_equal": ab["outputs_equal"]})
    return out

"""What a user can serve without training: the engine's model-free speculation, measured live beside the drafter.

Every method runs on the same prompts (token ids, greedy) and the same engine as the drafter's live check, at the
same concurrencies; its speed-up is end-to-end tokens/s over the plain server's in that check. The choice per
concurrency is the fastest of plain decoding, the drafter and these, measured, never predicted; when a free method
beats the drafter, the decision says what τ the drafter would need to pass it (tokens/s grows about linearly with
τ at a fixed step cost, so τ_needed = τ_drafter · speedup_free / speedup_drafter) and what the data law (τ per
doubling of the training prompts) says that costs: bench/README.md § A budget on a busy machine.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

from services.evaluator.launch import NotServing
from services.evaluator.live import timed_completions
from services.evaluator.specdec import PromptIds

# vLLM's model-free methods that run on a CPU and a GPU alike (ngram_gpu is the GPU kernel of ngram). Prompt
# lookup at vLLM's documented settings; suffix decoding needs the arctic-inference package in the engine's
# environment, and a start that fails is a row saying so, not an error.
FREE_METHODS: dict[str, dict] = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}
# The module a method needs in the engine's environment beyond vLLM: where that environment is known to lack it, the
# row says so without a start (a start that fails still costs vLLM's imports, 10-20 s on a CPU)
NEEDS = {"suffix": "arctic_inference"}
LABELS = {"plain": "plain decoding", "drafter": "this drafter", "ngram": "n-gram prompt lookup",
          "suffix": "suffix decoding"}
# τ gained per doubling of the training prompts, low and high: bench/README.md § A budget on a busy machine
TAU_PER_DOUBLING = (0.04, 0.07)


def measure_free(prompts: list[PromptIds], max_tokens: int, baseline_tok_s: dict[int, float],
                 start: Callable[[dict], AbstractContextManager[str]], api_key: str | None, check: Callable[[], None],
                 methods: dict[str, dict] = FREE_METHODS,
                 has_module: Callable[[str], bool | None] = lambda _module: None) -> list[dict]:
    """Each model-free method served by `start(speculative_config)` (yields its base URL) and timed at each
    concurrency of `baseline_tok_s` (concurrency → the plain server's tokens/s); a method whose server does not
    start, or whose module (NEEDS) the engine's environment lacks (`has_module` False; None: not known), gets one row
    with `served` false and the reason."""
    rows = []
    for name, config in methods.items():
        check()
        needed = NEEDS.get(name)
        if needed and has_module(needed) is False:
            rows.append(_not_served(name, config, f"not started: {LABELS.get(name, name)} needs the {needed} "
                                                  "package, which the engine's environment does not have"))
            continue
        try:
            with start(config) as url:
                for c, plain in baseline_tok_s.items():
                    check()
                    run = timed_completions(url, prompts, max_tokens, c, counters=True, api_key=api_key)
                    rows.append({"method": name, "served": True, "concurrency": c, "config": config,
                                 "tok_s": run["tok_s"], "speedup": run["tok_s"] / plain,
                                 "tau": run["acceptance_length"],
                                 "accepted_per_output_token":
                                     run["accepted"] / run["tokens"] if run["tokens"] else None,
                                 "why": None})
        except NotServing as e:  # its log's root cause
            rows.append(_not_served(name, config, str(e).split("\n", 1)[0][-400:]))
    return rows


def _not_served(name: str, config: dict, why: str) -> dict:
    return {"method": name, "served": False, "concurrency": None, "config": config, "tok_s": None, "speedup": None,
            "tau": None, "accepted_per_output_token": None, "why": why}


def choose(live_check: list[dict], free: list[dict]) -> list[dict]:
    """Per concurrency of the live check: the fastest measured of plain decoding (1 ×), the drafter and each
    served free method, with every candidate's speed-up."""
    out = []
    for live in live_check:
        c = live["concurrency"]
        candidates = {"plain": 1.0, "drafter": live["measured_end_to_end_speedup"]}
        candidates.update({r["method"]: r["speedup"] for r in free if r["served"] and r["concurrency"] == c})
        fastest = max(candidates, key=candidates.__getitem__)
        out.append({"concurrency": c, "fastest": fastest, "speedup": candidates[fastest], "speedups": candidates,
                    "drafter_tau": live["tau_vllm"]})
    return out


def tau_to_pass(choice: dict) -> float | None:
    """The τ at which the drafter would match the fastest free method at this concurrency (None: the drafter is
    the fastest, or drafted nothing)."""
    s = choice["speedups"]
    rival = max((v for m, v in s.items() if m not in ("plain", "drafter")), default=None)
    if rival is None or choice["drafter_tau"] is None or s["drafter"] >= rival or s["drafter"] <= 0:
        return None
    return choice["drafter_tau"] * rival / s["drafter"]


def doublings(tau_now: float, tau_needed: float) -> tuple[int, int]:
    """Doublings of the training prompts the data law says raise τ from tau_now to tau_needed (fewest, most)."""
    gap = max(0.0, tau_needed - tau_now)
    return math.ceil(gap / TAU_PER_DOUBLING[1]), math.ceil(gap / TAU_PER_DOUBLING[0])


def served_decision(choice: dict) -> str:
    """The measured answer at the first concurrency checked, in one sentence: what to serve, by how much, and when
    a free method wins, the τ the drafter needs to pass it and what that costs."""
    c, s, best = choice["concurrency"], choice["speedups"], choice["fastest"]
    others = ", ".join(f"{LABELS.get(m, m)} {v:.2f} ×" for m, v in s.items() if m not in (best, "plain"))
    at = f"measured on vLLM at concurrency {c}"
    if best == "drafter":
        return f"serve this drafter: {s['drafter']:.2f} × plain decoding, {at}" + (f" (against {others})" if others
                                                                                    else "")
    if best == "plain":
        return f"serve plain decoding: nothing measured was faster at concurrency {c} ({others}, {at})"
    line = (f"serve {LABELS.get(best, best)}, not this drafter yet: {s[best]:.2f} × plain decoding against the "
            f"drafter's {s['drafter']:.2f} × ({at}, no training needed)")
    need = tau_to_pass(choice)
    if need is not None:
        low, high = doublings(choice["drafter_tau"], need)
        cost = f"{low}–{high} doublings" if low != high else f"{low} doubling{'s' if low != 1 else ''}"
        line += (f"; the drafter needs τ ≥ {need:.2f} (now {choice['drafter_tau']:.2f}) to pass it: about {cost} "
                 "of its training prompts by the data law measured here")
    return line


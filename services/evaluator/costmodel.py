"""Will speculation speed up serving? A cost model of one engine step, from measured step times and acceptance.

Plain decoding at concurrency c: every step is one target forward over c tokens (one per sequence) and emits c
tokens, so tokens/s = c / t(c). Speculative decoding with K draft tokens (a chain): every step verifies K+1 tokens
per sequence (the last emitted token and K drafts), which we model as one target forward over c·(K+1) tokens, after
K drafter steps at batch c; it emits τ(K) tokens per sequence on average, so

    tokens/s = c · τ(K) / (t(c·(K+1)) + K · t_draft(c) + overhead)

A parallel drafter (P-EAGLE) drafts all K in one forward over c·K tokens: its drafting term is t_draft(c·K), not
K · t_draft(c), and it does not grow with K as long as the drafter's forward is not compute-bound.
t is piecewise-linear over the measured (tokens in the step, seconds) points, t_draft over (batch, seconds), and
`overhead` is what a speculative step costs on the engine beyond the two (0 unless measured). τ(K) = 1 + Σ_{i≤K} p_i
is the acceptance length of a K-token chain, measured for each K (services.evaluator.chains).
Speculation pays at low concurrency (a step costs about the same for 1 or K+1 tokens per sequence) and loses once
the engine is compute-bound (then K+1 tokens cost K+1 times one).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

CONCURRENCIES = (1, 4, 16, 64)


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through the points (sorted by x here); beyond either end, the line through the two
    outermost points on that side (step time keeps growing with the tokens in the step), never below 0."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    i = 1
    while i < len(pts) - 1 and pts[i][0] < x:
        i += 1
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def drafts_in_one_forward(method: str) -> bool:
    """P-EAGLE and DFlash draft all K tokens in one forward; EAGLE-3 chains K."""
    return method != "eagle3"


@dataclass(frozen=True)
class StepTimes:
    target: list[tuple[int, float]]  # (tokens in one target forward, seconds)
    drafter: list[tuple[int, float]]  # (batch, seconds of one draft step: one token per sequence)
    overhead: float = 0.0  # seconds per speculative step beyond the target and drafter forwards
    parallel: bool = False  # the drafter proposes all K in one forward (P-EAGLE)

    def plain_step(self, c: int) -> float:
        return interpolate(self.target, c)

    def spec_step(self, c: int, k: int) -> float:
        return interpolate(self.target, c * (k + 1)) + self.draft_s(c, k) + self.overhead

    def draft_s(self, c: int, k: int) -> float:
        """Seconds to draft K tokens for c sequences: K chained forwards at batch c, or one over c·K tokens."""
        return interpolate(self.drafter, c * k) if self.parallel else k * interpolate(self.drafter, c)

    def plain_tok_s(self, c: int) -> float:
        return c / self.plain_step(c)

    def spec_tok_s(self, c: int, k: int, tau_k: float) -> float:
        return c * tau_k / self.spec_step(c, k)


def speculative_config(model: str, k: int, method: str = "eagle3") -> str:
    """The exact `--speculative-config` value for vLLM (model: where the server reads the export; `method`: the
    drafter's, eyas.exports.drafting_method: a P-EAGLE drafter is EAGLE-3 with parallel drafting, DFlash its own)."""
    config = {"method": "dflash" if method == "dflash" else "eagle3", "model": model, "num_speculative_tokens": k}
    return json.dumps({**config, "parallel_drafting": True} if method == "peagle" else config)


def break_even(times: StepTimes, taus: dict[int, float], up_to: int) -> int | None:
    """The largest concurrency c ≤ up_to at which some K still pays (speed-up > 1), every c below it paying too;
    0 if none pays at c = 1, None if some K pays at every c ≤ up_to."""
    for c in range(1, up_to + 1):
        if max(times.spec_tok_s(c, k, t) for k, t in taus.items()) <= times.plain_tok_s(c):
            return c - 1
    return None


def recommend(times: StepTimes, taus: dict[int, float], concurrencies: tuple[int, ...] = CONCURRENCIES) -> dict:
    """Predicted tokens/s with and without speculation per (concurrency, K) for the K in `taus` (K → τ(K)), the
    best K per concurrency with its speed-up, and where speculation stops paying."""
    table, best = [], []
    for c in concurrencies:
        plain = times.plain_tok_s(c)
        rows = [{"k": k, "tau": t, "tok_s": times.spec_tok_s(c, k, t), "step_s": times.spec_step(c, k)}
                for k, t in sorted(taus.items())]
        for r in rows:
            r["speedup"] = r["tok_s"] / plain
        table.append({"concurrency": c, "plain_tok_s": plain, "plain_step_s": times.plain_step(c),
                      "speculative": rows})
        top = max(rows, key=lambda r: r["speedup"])
        best.append({"concurrency": c, "k": top["k"], "speedup": top["speedup"], "pays": top["speedup"] > 1.0})
    k1 = best[0]["k"]
    return {"tau_per_k": {str(k): t for k, t in sorted(taus.items())}, "table": table, "best": best,
            # speculation loses above this concurrency (None: it pays up to the largest concurrency predicted)
            "break_even_concurrency": break_even(times, taus, max(concurrencies)),
            # the τ the best K at concurrency 1 would need to break even there
            "tau_needed": {"k": k1, "tau": times.spec_step(1, k1) / times.plain_step(1)}}


def decision(rec: dict) -> str:
    """The recommendation in one line."""
    first = rec["best"][0]
    if not first["pays"]:
        need = rec["tau_needed"]
        return (f"this drafter does not pay on this engine: τ {rec['tau_per_k'][str(need['k'])]:.2f} "
                f"needs ≥ {need['tau']:.2f} (K = {need['k']}, concurrency {first['concurrency']})")
    up_to = rec["break_even_concurrency"]
    limit = f"up to {up_to}" if up_to is not None else f"{rec['best'][-1]['concurrency']} or more"
    return (f"serve with K = {first['k']} for {limit} concurrent requests: {first['speedup']:.2f} × faster "
            f"(predicted, concurrency {first['concurrency']})")

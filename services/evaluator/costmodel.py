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

from dataclasses import dataclass

CONCURRENCIES = (1, 4, 16, 64)
# a live measurement this far from the prediction (relative) is flagged in the report: the prediction misleads there
OFF_BY = 0.15


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


@dataclass(frozen=True)
class StepTimes:
    target: list[tuple[int, float]]  # (tokens in one target forward, seconds)
    drafter: list[tuple[int, float]]  # (batch, seconds of one draft step: one token per sequence)
    overhead: float = 0.0  # seconds per speculative step beyond the target and drafter forwards
    parallel: bool = False  # the drafter proposes all K in one forward (its method's `parallel`: P-EAGLE, DFlash)
    # the target's times are the serving engine's; False: in-process transformers, whose forward over K+1 tokens a
    # sequence costs more against one token's than an engine's verify does at a small batch (see speedup_range)
    engine: bool = True

    def plain_step(self, c: int) -> float:
        return interpolate(self.target, c)

    def spec_step(self, c: int, k: int) -> float:
        return interpolate(self.target, c * (k + 1)) + self.draft_s(c, k) + self.overhead

    def draft_s(self, c: int, k: int) -> float:
        """Seconds to draft K tokens for c sequences: K chained forwards at batch c, or one over c·K tokens."""
        return interpolate(self.drafter, c * k) if self.parallel else k * interpolate(self.drafter, c)

    def verify_at_one_step(self, c: int, k: int) -> float:
        """The speculative step with its verify costing one plain step: the memory-bound engine's limit."""
        return self.plain_step(c) + self.draft_s(c, k) + self.overhead

    def plain_tok_s(self, c: int) -> float:
        return c / self.plain_step(c)

    def spec_tok_s(self, c: int, k: int, tau_k: float) -> float:
        return c * tau_k / self.spec_step(c, k)


def _measured(taus: dict[int, float | None]) -> dict[int, float]:
    """The K whose τ was measured (a K with no drafts, e.g. every answer ended at once, has τ None)."""
    return {k: t for k, t in taus.items() if t is not None}


def break_even(times: StepTimes, taus: dict[int, float | None], up_to: int) -> int | None:
    """The largest concurrency c ≤ up_to at which some measured K still pays (speed-up > 1), every c below it paying
    too; 0 if none pays at c = 1, None if some K pays at every c ≤ up_to or no K was measured."""
    measured = _measured(taus)
    if not measured:
        return None
    for c in range(1, up_to + 1):
        if max(times.spec_tok_s(c, k, t) for k, t in measured.items()) <= times.plain_tok_s(c):
            return c - 1
    return None


def speedup_range(bounds: tuple[StepTimes, StepTimes], c: int, k: int, tau: float) -> tuple[float, float]:
    """The speed-up's interval when every step time may lie between the two bounds' (fastest, slowest): the
    plain step at its fastest against the speculative step at its slowest, and the other way round. Where the
    target's times are not the engine's (in-process transformers), the high end takes the verify at one plain step's
    cost: transformers on a CPU ran 4 tokens at 1.5× one token's step where vLLM-CPU verified them in about one
    step, and read a drafter that vLLM served at 1.32× as 0.80× (bench/README.md § Serving prediction)."""
    fast, slow = bounds
    cheapest = fast.spec_step(c, k) if fast.engine else min(fast.spec_step(c, k), fast.verify_at_one_step(c, k))
    return tau * fast.plain_step(c) / slow.spec_step(c, k), tau * slow.plain_step(c) / cheapest


def _verdict(low: float, high: float) -> bool | None:
    """Pays (the whole interval above 1), does not (none of it), or cannot tell (it straddles 1): None."""
    return True if low > 1.0 else False if high <= 1.0 else None


def recommend(times: StepTimes, taus: dict[int, float | None], concurrencies: tuple[int, ...] = CONCURRENCIES,
              bounds: tuple[StepTimes, StepTimes] | None = None, evidence: dict | None = None) -> dict:
    """Predicted tokens/s with and without speculation per (concurrency, K) for the K in `taus` (K → τ(K), None
    where no draft was measured), the best measured K per concurrency with its speed-up, its interval under the
    step times' noise (`bounds`: the step times at their fastest and slowest; none: exact) and whether it pays
    (None: cannot tell), and where speculation stops paying. `evidence` ({"prompts", "drafts_per_k"}) is what τ
    rests on; the decision quotes it."""
    bounds = bounds or (times, times)
    table, best = [], []
    for c in concurrencies:
        plain = times.plain_tok_s(c)
        rows = []
        for k, t in sorted(taus.items()):
            rows.append({"k": k, "tau": t, "step_s": times.spec_step(c, k), "tok_s": None, "speedup": None,
                         "speedup_range": None})
            if t is not None:
                tok_s = times.spec_tok_s(c, k, t)
                rows[-1].update(tok_s=tok_s, speedup=tok_s / plain, speedup_range=list(speedup_range(bounds, c, k, t)))
        table.append({"concurrency": c, "plain_tok_s": plain, "plain_step_s": times.plain_step(c),
                      "speculative": rows})
        measured = [r for r in rows if r["speedup"] is not None]
        top = max(measured, key=lambda r: r["speedup"]) if measured else None
        best.append({"concurrency": c, "k": top and top["k"], "speedup": top and top["speedup"],
                     "speedup_range": top and top["speedup_range"],
                     "pays": top and _verdict(*top["speedup_range"])})
    # the τ the best K at concurrency 1 would need to break even there (no K measured: the cheapest K's)
    k1 = best[0]["k"] or min(taus)
    return {"tau_per_k": {str(k): t for k, t in sorted(taus.items())}, "table": table, "best": best,
            "engine": times.engine,
            # speculation loses above this concurrency (None: it pays up to the largest one predicted, or no K measured)
            "break_even_concurrency": break_even(times, taus, max(concurrencies)),
            "tau_needed": {"k": k1, "tau": times.spec_step(1, k1) / times.plain_step(1)},
            **({"evidence": evidence} if evidence else {})}


def plural(n: int, noun: str) -> str:
    """"1 prompt", "2 prompts"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _rests_on(rec: dict, k: int) -> str:
    """τ at K with the counts it rests on: "τ 1.21 from 412 drafts on 16 prompts"."""
    tau, evidence = rec["tau_per_k"][str(k)], rec.get("evidence")
    if not evidence:
        return f"τ {tau:.2f}"
    return (f"τ {tau:.2f} from {plural(evidence['drafts_per_k'][str(k)], 'draft')} on "
            f"{plural(evidence['prompts'], 'prompt')}")


def decision(rec: dict) -> str:
    """The recommendation in one sentence, from the K that were measured, with the counts it rests on."""
    first, need = rec["best"][0], rec["tau_needed"]
    c = first["concurrency"]
    if first["k"] is None:
        evidence = rec.get("evidence")
        on = f" on {plural(evidence['prompts'], 'prompt')}" if evidence else ""
        return (f"cannot tell whether this drafter pays: no drafts were measured at any K{on} (answers that end at "
                f"once leave nothing to draft); at K = {need['k']} it would need τ ≥ {need['tau']:.2f} at "
                f"concurrency {c}: evaluate on more prompts or longer answers")
    k, low, high = first["k"], *first["speedup_range"]
    noise = f", {low:.2f}–{high:.2f} × within the step times' noise" if high - low > 1e-9 else ""
    if first["pays"] is None:
        allows = ("the step times' noise allows" if rec.get("engine", True) else
                  "in-process step times (the target's, not an engine's, whose verify may cost one step) allow")
        return (f"cannot tell whether this drafter pays on this engine: {first['speedup']:.2f} × predicted at "
                f"K = {k}, concurrency {c}, but {allows} {low:.2f}–{high:.2f} × "
                f"({_rests_on(rec, k)}): measure the step times on the serving engine (--endpoint)")
    if not first["pays"]:
        return (f"this drafter does not pay on this engine: {_rests_on(rec, need['k'])} needs ≥ {need['tau']:.2f} "
                f"(K = {need['k']}, concurrency {c}{noise})")
    up_to = rec["break_even_concurrency"]
    limit = (f"for up to {plural(up_to, 'concurrent request')}" if up_to is not None
             else f"at every concurrency predicted (up to {rec['best'][-1]['concurrency']})")
    return (f"serve with K = {k} {limit}: {first['speedup']:.2f} × faster at concurrency {c} "
            f"(predicted{noise}; {_rests_on(rec, k)})")

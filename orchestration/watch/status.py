"""What the watch concludes from what it read, as pure functions: a point of the series from two readings of the
engine's spec-decode counters, and the status from the latest points, the promotion level and the target checks.

Acceptance over an interval is vLLM's own definition over the counters' deltas (services.evaluator.live):
  τ = 1 + Δaccepted / Δdrafts,   per-position acceptance_i = Δaccepted_per_pos[i] / Δdrafts
The status judges the last `window` intervals together (their drafts summed), so one quiet interval is not a verdict;
an interval with no drafts at all says nothing about acceptance, and is never read as a fall.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from services.evaluator.live import SpecCounters

CURRENT, BELOW, STALE, NO_TRAFFIC = "current", "below threshold", "stale target", "no traffic"
SAME, CHANGED, NOT_CHECKED = "same", "changed", "not checked"


@dataclass
class Point:
    """The counters' deltas over one interval (or, with `since_start`, the totals since the engine started)."""
    at: float  # unix time of the reading that closes it
    interval_s: float | None  # None with since_start: the engine's start time is not known
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    since_start: bool = False  # no earlier reading: the engine's totals
    restarted: bool = False  # the counters went back: the engine restarted within the interval, counted from then

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_position(self) -> list[float | None]:
        return [a / self.drafts if self.drafts else None for a in self.accepted_per_pos]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tau": self.tau, "per_position": self.per_position}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Point:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def _went_back(before: SpecCounters, now: SpecCounters) -> bool:
    delta = now - before
    return min([delta.drafts, delta.draft_tokens, delta.accepted, *delta.accepted_per_pos.values()]) < 0


def point_between(before: SpecCounters | None, before_at: float | None, now: SpecCounters, at: float) -> Point:
    """The point from the reading `before` (at `before_at`) to `now` (at `at`). With no earlier reading, `now` is
    the engine's totals since it started (a point with no interval length); with counters lower than before, the
    engine restarted within the interval and counts from zero again, so `now` is what it served since then."""
    if before is None or before_at is None:
        delta, interval, since_start, restarted = now, None, True, False
    else:
        restarted = _went_back(before, now)
        delta, interval, since_start = (now if restarted else now - before), at - before_at, False
    per_pos = [int(delta.accepted_per_pos[i]) for i in sorted(delta.accepted_per_pos)]
    return Point(at=at, interval_s=interval, drafts=int(delta.drafts), draft_tokens=int(delta.draft_tokens),
                 accepted=int(delta.accepted), accepted_per_pos=per_pos, since_start=since_start,
                 restarted=restarted)


@dataclass(frozen=True)
class Level:
    """What acceptance is judged against: the τ measured at promotion (where known) and the user's threshold."""
    baseline: float | None
    source: str  # where the baseline comes from, in words
    min_ratio: float = 0.9
    min_tau: float | None = None  # an absolute floor, used instead of min_ratio × baseline
    k: int | None = None  # the K the baseline was measured at, where known

    @property
    def floor(self) -> float | None:
        if self.min_tau is not None:
            return self.min_tau
        return self.min_ratio * self.baseline if self.baseline is not None else None


@dataclass(frozen=True)
class Check:
    """One comparison of the served target with the drafter's: SAME, CHANGED or NOT_CHECKED, and why."""
    name: str
    state: str
    detail: str


@dataclass
class Status:
    state: str
    at: float
    sentence: str
    tau: float | None = None  # over the window's intervals together
    drafts: int = 0  # in the window
    intervals: int = 0  # in the window
    per_position: list[float] = field(default_factory=list)
    baseline: float | None = None
    floor: float | None = None
    checks: list[Check] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Measured:
    """The window's acceptance: the last `window` points taken together."""
    drafts: int
    accepted: int
    per_pos: list[int]
    intervals: int
    last_drafts: int
    since_start: bool  # only the engine's totals: no interval measured yet

    @property
    def span(self) -> str:
        return "since the engine started" if self.since_start else f"over the last {_intervals(self.intervals)}"

    @property
    def tau(self) -> float:
        return 1 + self.accepted / self.drafts

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts for a in self.per_pos]


def measure(points: list[Point], window: int) -> Measured | None:
    """The last `window` points summed (per position up to the longest K seen); None without any point. The engine's
    totals at the first reading count only while no interval of the window has drafts: they may span weeks, and
    would outweigh the intervals being judged."""
    last = points[-window:]
    intervals = [p for p in last if not p.since_start]
    if any(p.drafts for p in intervals):
        last = intervals
    if not last:
        return None
    k = max(len(p.accepted_per_pos) for p in last)
    per_pos = [sum(p.accepted_per_pos[i] for p in last if i < len(p.accepted_per_pos)) for i in range(k)]
    return Measured(drafts=sum(p.drafts for p in last), accepted=sum(p.accepted for p in last), per_pos=per_pos,
                    intervals=len(last), last_drafts=last[-1].drafts, since_start=all(p.since_start for p in last))


def _no_traffic_reason(m: Measured | None, min_drafts: int) -> str | None:
    if m is None:
        return "no interval measured yet"
    if m.drafts == 0 and not m.per_pos:  # vLLM publishes its per-position counters from its start when it drafts
        return "the endpoint publishes no spec-decode counters: does it serve a drafter?"
    if m.last_drafts == 0:
        return ("no drafts since the engine started" if m.since_start else "no drafts in the last interval") \
            + ", so acceptance is not judged (no traffic is not a fall)"
    if m.drafts < min_drafts:
        return f"{m.drafts} drafts {m.span}, fewer than the {min_drafts} needed to judge acceptance"
    return None


def _intervals(n: int) -> str:
    return "interval" if n == 1 else f"{n} intervals"


def _acceptance(m: Measured, level: Level) -> str:
    said = f"τ {m.tau:.2f} {m.span} ({m.drafts} drafts)"
    if level.baseline is not None:
        said += f", {m.tau / level.baseline:.2f} of the {level.baseline:.2f} measured at promotion ({level.source})"
    if level.floor is not None:
        said += f"; threshold τ {level.floor:.2f}"
    if level.k is not None and m.per_pos and len(m.per_pos) != level.k:
        said += (f" (the baseline was measured at K = {level.k}, the endpoint drafts K = {len(m.per_pos)}: not "
                 f"like for like)")
    return said


def _checks_said(checks: list[Check]) -> str:
    made = [c.name for c in checks if c.state == SAME]
    unmade = [f"{c.name} ({c.detail})" for c in checks if c.state == NOT_CHECKED]
    said = f"the target is unchanged in {', '.join(made)}" if made else "no check of the target could be made"
    return said + (f"; not checked: {'; '.join(unmade)}" if unmade else "")


def judge(points: list[Point], level: Level, checks: list[Check], window: int, min_drafts: int,
          at: float) -> Status:
    """The drafter's status: STALE when any target check found a change; else NO_TRAFFIC when the window holds too
    little to judge; else BELOW when its τ is under the level's floor; else CURRENT."""
    m = measure(points, window)
    quiet = _no_traffic_reason(m, min_drafts)
    base = Status(state=CURRENT, at=at, sentence="", baseline=level.baseline, floor=level.floor, checks=checks)
    if m is not None and m.drafts:
        base.tau, base.drafts, base.intervals, base.per_position = m.tau, m.drafts, m.intervals, m.per_position
    changed = [c for c in checks if c.state == CHANGED]
    if changed:
        base.state = STALE
        measured = f"; {_acceptance(m, level)}" if m is not None and m.drafts else ""
        base.sentence = f"{STALE}: " + "; ".join(c.detail for c in changed) + measured + "."
    elif quiet is not None or m is None:
        base.state = NO_TRAFFIC
        base.sentence = f"{NO_TRAFFIC}: {quiet}; {_checks_said(checks)}."
    elif level.floor is not None and m.tau < level.floor:
        base.state = BELOW
        base.sentence = f"{BELOW}: {_acceptance(m, level)}; {_checks_said(checks)}."
    else:
        base.sentence = f"{CURRENT}: {_acceptance(m, level)}; {_checks_said(checks)}."
    return base

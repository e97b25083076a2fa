"""A stage's deadline: the wall-clock time (Unix seconds, a spec's `finish_by`) by which it stops at its next
boundary and finishes with what it has, and the pace of its repeated units that says whether one more fits.

The orchestration gives a stage a deadline (`eyas run` splits its budget into one per stage, re-planned at every
stage boundary); the stage keeps to it at its own boundaries: the generator stops taking prompts (and synthesis
stops drawing candidates), the trainer sizes its learning-rate schedule to the steps that fit, the evaluator scores
prompts while another batch fits. The clock is a parameter so that tests drive the logic with a fake one.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

Clock = Callable[[], float]


class Deadline:
    """`finish_by` (None: no deadline) on `clock` (time.time: wall-clock, the same on every machine of a run)."""

    def __init__(self, finish_by: float | None, clock: Clock = time.time):
        self.finish_by, self.clock = finish_by, clock

    def __bool__(self) -> bool:
        return self.finish_by is not None

    def left(self) -> float:
        """Seconds until the deadline (negative once past it; infinite without one)."""
        return math.inf if self.finish_by is None else self.finish_by - self.clock()

    def fits(self, seconds: float) -> bool:
        """Whether work of `seconds`, started now, ends by the deadline."""
        return seconds <= self.left()


class Pace:
    """Seconds per unit of repeated work (a batch, a step, a prompt), the mean of the last `window` units: recent
    enough to follow a machine that got busier or quieter, long enough to average out a unit that also validated
    or checkpointed. `mark()` ends a unit at the clock's time (the first call only starts the first unit)."""

    def __init__(self, clock: Clock = time.time, window: int = 20):
        self.clock = clock
        self.units: deque[float] = deque(maxlen=window)
        self._last: float | None = None

    def mark(self, count: int = 1) -> None:
        now = self.clock()
        if self._last is not None and count > 0:
            self.units.extend([(now - self._last) / count] * min(count, self.units.maxlen or count))
        self._last = now

    def add(self, seconds: float) -> None:
        """A unit whose seconds were measured elsewhere (e.g. a request's own latency)."""
        self.units.append(seconds)

    @property
    def known(self) -> bool:
        return bool(self.units)

    def seconds(self) -> float:
        """Seconds per unit (0 before the first unit ended)."""
        return sum(self.units) / len(self.units) if self.units else 0.0

"""What a stage may coordinate through, as the stage sees it: a concurrency limit against an endpoint and a source of
work items. The orchestration builds them per deployment (orchestration.coordination): one process's own (here), or
shared by every worker of the stage (orchestration.shared_limit, orchestration.workshare). A stage never knows which.

A Limit is an endpoint's concurrency state: the limit, the slow-start threshold, when the limit was last cut, and
the requests in flight under it. The generator's throttle decides what the answers mean; a Limit keeps the state and
applies the three changes atomically:

- grow(delta): limit + delta, up to the maximum;
- cut(sent, factor, by): unless the limit was already cut since `sent`, limit × factor, or limit − by where that is
  less deep; the cut limit becomes the slow-start threshold (slow start is over);
- at_least(n): the limit is raised to n (up to the slow-start threshold and the maximum).

A Work hands out the ids of the items a run must do (the generator's prompts, a features stream's shards), and is
told which are committed.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol


class Limit(Protocol):
    maximum: int
    limit: float  # the latest known values (the shared state may have moved on since)
    ssthresh: float

    async def acquire(self, first: bool = False) -> str | None: ...  # a slot under the limit (a token to release)

    async def release(self, token: str | None) -> None: ...

    async def in_flight(self) -> int: ...  # requests holding a slot, from every process sharing the limit

    async def grow(self, delta: float) -> None: ...

    async def cut(self, sent: float, factor: float, by: float = math.inf) -> None: ...

    async def at_least(self, n: float) -> None: ...

    async def aclose(self) -> None: ...


class Line:
    """Requests waiting their turn: first come, first served, except that a retry goes to the front. Its prompt has
    waited its turn once already; behind every fresh prompt it would wait a round trip more for each failure, and
    a job ends with the prompts that failed most. (A shared limit's line is for the turn to ask the shared state: a
    retry goes ahead of the requests waiting for it, not of the one asking.)"""

    def __init__(self, abandoned: Callable[[], None]):
        self._waiting: deque[asyncio.Future] = deque()
        self._abandoned = abandoned  # a request was let go but cancelled before it went on: pass on what it got

    def join(self, first: bool) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        (self._waiting.appendleft if first else self._waiting.append)(fut)
        return fut

    async def wait(self, fut: asyncio.Future) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._abandoned()
            raise

    def next(self) -> bool:
        """Let the next waiting request go; False when none waits."""
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():  # a cancelled request left its future here
                fut.set_result(None)
                return True
        return False


class LocalLimit:
    """One process's limit: waiting requests are admitted in turn (see Line) as slots free up."""

    def __init__(self, maximum: int, initial: float):
        self.maximum = maximum
        self.limit, self.ssthresh, self.last_cut = float(min(initial, maximum)), math.inf, 0.0
        self.held = 0
        self._line = Line(abandoned=self._give_back)

    def _admit(self) -> None:
        while self.held < int(self.limit) and self._line.next():
            self.held += 1

    def _give_back(self) -> None:
        self.held -= 1
        self._admit()

    async def acquire(self, first: bool = False) -> None:
        fut = self._line.join(first)
        self._admit()
        await self._line.wait(fut)

    async def release(self, token: str | None) -> None:  # a local limit hands out no tokens
        self._give_back()

    async def in_flight(self) -> int:
        return self.held

    async def grow(self, delta: float) -> None:
        self.limit = min(float(self.maximum), self.limit + delta)
        self._admit()

    async def cut(self, sent: float, factor: float, by: float = math.inf) -> None:
        if self.last_cut < sent:
            self.limit = self.ssthresh = max(1.0, self.limit * factor, self.limit - by)
            self.last_cut = time.time()

    async def at_least(self, n: float) -> None:
        self.limit = max(self.limit, min(float(n), self.ssthresh, float(self.maximum)))
        self._admit()

    async def aclose(self) -> None:
        pass


# (key, maximum, initial) → the limit for `key` (an endpoint's URL): at most `maximum` in flight, `initial` at first
LimitFactory = Callable[[str, int, float], Limit]


def local_limits(cap: int) -> LimitFactory:
    """One process's limits, each also capped by what this process may keep in flight."""
    return lambda _key, maximum, initial: LocalLimit(min(maximum, cap), initial=initial)


class Work(Protocol):
    def claim(self) -> str | None: ...  # an id to do, or None when nothing can be claimed now

    def finished(self, ids: list[str]) -> None: ...  # these ids are committed: nobody does them again

    def open_count(self) -> int: ...  # ids shared with others and not finished yet (0: nobody else holds any)

    def finished_count(self) -> int: ...  # ids finished by every participant

    def add_stats(self, stats: dict[str, int]) -> None: ...  # a participant's counters, summed for the run

    def shared_stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...  # done with it (the run's own Work also retires what it shared)


# (ids, helpers, min_chunk, ordered) → the run's Work over `ids`, shared with up to `helpers` other workers in chunks
# of at least `min_chunk` ids where the deployment has workers to share with, else this process's own. `ordered`:
# every participant takes the ids one at a time in their order (for work whose later items wait on earlier ones:
# nobody may sit on an early id while it waits for a late one)
Share = Callable[[list[str], int, int, bool], Work]


class LocalWork:
    """The ids for this process alone."""

    def __init__(self, ids: list[str]):
        self._todo = deque(ids)

    def claim(self) -> str | None:
        return self._todo.popleft() if self._todo else None

    def finished(self, ids: list[str]) -> None:
        pass

    def open_count(self) -> int:
        return 0

    def finished_count(self) -> int:
        return 0  # the run counts its own

    def add_stats(self, stats: dict[str, int]) -> None:
        pass

    def shared_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def local_share(ids: list[str], _helpers: int = 0, _min_chunk: int = 1, _ordered: bool = False) -> Work:
    return LocalWork(ids)

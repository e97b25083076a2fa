"""One pass of the loop (`loop_once`): the watch's reading of the drafter the promotion line serves, then a refresh of
the line when the watch says below threshold or stale target — unless a refresh is still running, or the last one
began (or ended) within the minimum interval. The drafter served is the line's current one (promotion/NAME/
current.json), or the one given before the line's first promotion; after a promotion or a rollback the next pass
watches the drafter current then, judged against the τ at its promotion. The last refresh the loop began, and how
it ended, is kept in the store (orchestration.loop.state).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eyas.store import ObjectStore
from orchestration.loop.state import loop_state, put_loop_state
from orchestration.refresh.promotion import Promotions
from orchestration.watch.status import BELOW, CURRENT, STALE, Status
from orchestration.watch.watch import Watch, WatchError

log = logging.getLogger(__name__)
REFRESH_ON = (BELOW, STALE)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Turn:
    """What one pass saw and did."""
    drafter: str  # the drafter watched
    status: Status
    refresh: str  # what the pass did about a refresh, and why, in words


@dataclass
class Loop:
    store: ObjectStore
    name: str  # the promotion line and the watch series
    open_watch: Callable[[str], Watch]  # the watch of a drafter, its series watch/NAME/
    refresh: Callable[[str], dict[str, Any]]  # one refresh of the line from a drafter: its stored promotion record
    min_refresh_s: float
    drafter: str | None = None  # served before the line's first promotion
    background: bool = False  # a refresh runs in a thread of its own, and the passes go on watching meanwhile
    clock: Callable[[], float] = time.time

    def __post_init__(self):
        self.promotions = Promotions(self.store, self.name)
        self.refreshing: threading.Thread | None = None  # the background refresh, while one runs

    def served(self) -> str | None:
        current = self.promotions.current()
        return current["drafter"] if current else self.drafter

    def _last_refresh(self) -> float | None:
        """When the last refresh began (the loop's: it may have died before it ended) or ended (the newest refresh
        recorded on the line, by this loop or by hand)."""
        mine = loop_state(self.store, self.name)
        times = [r["at"] for r in self.promotions.history() if r.get("kind") == "refresh"]
        return max([*times, *([mine["began"]] if mine else [])], default=None)

    def blocked(self, now: float) -> str | None:
        """Why no refresh may begin now (None: one may)."""
        if self.refreshing is not None and self.refreshing.is_alive():
            return "a refresh is running"
        last = self._last_refresh()
        if last is not None and now - last < self.min_refresh_s:
            return (f"the last refresh was {_hours(now - last)} ago, within the minimum interval of "
                    f"{_hours(self.min_refresh_s)}")
        return None

    def _refresh(self, drafter: str, began: float) -> None:
        """One refresh to its end, and how it ended stored."""
        try:
            record = self.refresh(drafter)
            ended = {"outcome": "promoted" if record["promoted"] else "not promoted", "why": record["why"],
                     "record": record["key"]}
        except Exception as e:  # noqa: BLE001 — a refresh that fails is the pass's outcome; the loop goes on watching
            log.exception("refresh of %s from %s failed", self.name, drafter)
            ended = {"outcome": "failed", "why": f"{type(e).__name__}: {e}"}
        log.info("refresh of %s from %s: %s (%s)", self.name, drafter, ended["outcome"], ended["why"])
        put_loop_state(self.store, self.name, {"drafter": drafter, "began": began, "ended": self.clock(), **ended})

    def begin(self, drafter: str, now: float) -> str:
        """Begin a refresh from `drafter` (recorded first: a loop that dies in it waits the minimum interval after
        its restart too); in words, what became of it."""
        put_loop_state(self.store, self.name, {"drafter": drafter, "began": now})
        if self.background:
            self.refreshing = threading.Thread(target=self._refresh, args=(drafter, now), daemon=True,
                                               name=f"eyas-refresh-{self.name}")
            self.refreshing.start()
            return "refresh begun (it runs beside the watch)"
        self._refresh(drafter, now)
        ended = loop_state(self.store, self.name) or {}
        return f"refreshed: {ended.get('outcome')} ({ended.get('why')})"


def loop_once(loop: Loop) -> Turn:
    """One pass: the watch's reading of the drafter served, then a refresh when it says below threshold or stale
    target and no refresh runs or ran within the minimum interval. Raises what opening or reading the watch raises:
    WatchError (nothing to judge against, no drafter), httpx.HTTPError (the endpoint unreachable), ValueError (a
    /metrics page that is no Prometheus text)."""
    drafter = loop.served()
    if drafter is None:
        raise WatchError(f"promotion line {loop.name!r} has no current drafter yet: give --drafter")
    status = loop.open_watch(drafter).check()
    if status.state not in REFRESH_ON:
        why = "the drafter is current" if status.state == CURRENT else "acceptance cannot be judged"
        return Turn(drafter, status, f"no refresh: {why}")
    now = loop.clock()
    blocked = loop.blocked(now)
    if blocked is not None:
        return Turn(drafter, status, f"no refresh: {blocked}")
    return Turn(drafter, status, loop.begin(drafter, now))

"""Where a watch keeps what it read, in the store the proxy records traffic into (the workdir's, or the service's
bucket), under watch/NAME/:

  points/YYYYmmdd.jsonl   the series: one point a line (orchestration.watch.status.Point), one object a day (UTC)
  status.json             the latest status, with its numbers and checks
  acceptance.png          the series as a picture (orchestration.watch.plot), rewritten at each reading
  state.json              the last reading of the counters (the next interval is measured from it, also by the next
                          `eyas watch --once`) and what the endpoint showed when the watch first ran

One watch writes a name: a day's object is read once and then rewritten whole at each point.
"""
from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from eyas.store import ObjectStore
from orchestration.watch.status import Point, Status
from services.evaluator.live import SpecCounters

DAY = "%Y%m%d"


def counters_to_dict(c: SpecCounters) -> dict[str, Any]:
    return {"drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted": c.accepted,
            "accepted_per_pos": {str(i): v for i, v in c.accepted_per_pos.items()}}


def counters_from_dict(d: dict[str, Any]) -> SpecCounters:
    return SpecCounters(d["drafts"], d["draft_tokens"], d["accepted"],
                        {int(i): v for i, v in d["accepted_per_pos"].items()})


class Series:
    def __init__(self, store: ObjectStore, name: str, prefix: str = "watch"):
        self.store, self.name, self.folder = store, name, f"{prefix}/{name}"
        self._day: str | None = None
        self._lines: list[str] = []

    def key(self, name: str) -> str:
        return f"{self.folder}/{name}"

    def append(self, point: Point) -> str:
        """Add a point to its day's object; the object's key."""
        day = datetime.fromtimestamp(point.at, UTC).strftime(DAY)
        key = self.key(f"points/{day}.jsonl")
        if day != self._day:  # another process (an earlier --once) may have begun the day
            self._day = day
            self._lines = self.store.get_bytes(key).decode().splitlines() if self.store.exists(key) else []
        self._lines.append(json.dumps(point.to_dict()))
        self.store.put_bytes(key, ("\n".join(self._lines) + "\n").encode())
        return key

    def points(self, last: int | None = None, since: float | None = None) -> list[Point]:
        """The stored points in time order; with `last`, only that many of the latest, with `since`, only those at
        or after that time (the newest days read first, the days before `since` not at all)."""
        days = sorted(k for k in self.store.list(self.key("points")) if k.endswith(".jsonl"))
        if since is not None:
            first = self.key(f"points/{datetime.fromtimestamp(since, UTC).strftime(DAY)}.jsonl")
            days = [k for k in days if k >= first]
        found: list[Point] = []
        for key in reversed(days):
            lines = [ln for ln in self.store.get_bytes(key).decode().splitlines() if ln.strip()]
            found = [p for p in (Point.from_dict(json.loads(ln)) for ln in lines)
                     if since is None or p.at >= since] + found
            if last is not None and len(found) >= last:
                return found[-last:]
        return found

    def put_status(self, status: Status) -> None:
        self.store.put_bytes(self.key("status.json"), json.dumps(status.to_dict(), indent=2).encode())

    def status(self) -> dict[str, Any] | None:
        key = self.key("status.json")
        return json.loads(self.store.get_bytes(key)) if self.store.exists(key) else None

    def put_plot(self, png: bytes) -> None:
        self.store.put_bytes(self.key("acceptance.png"), png)

    def plot(self) -> bytes | None:
        key = self.key("acceptance.png")
        return self.store.get_bytes(key) if self.store.exists(key) else None

    def state(self) -> dict[str, Any]:
        key = self.key("state.json")
        return json.loads(self.store.get_bytes(key)) if self.store.exists(key) else {}

    def put_state(self, state: dict[str, Any]) -> None:
        self.store.put_bytes(self.key("state.json"), json.dumps(state).encode())

"""Promotion state in the store, per promotion line NAME: promotion/NAME/current.json (the drafter served now, its τ
at promotion, the record that promoted it, and the drafters current before it, newest last) and
promotion/NAME/history/ (one record per refresh and per rollback). The decision itself is the diagnosis's
significance rule (services.evaluator.diagnose.significant): a candidate must beat the current τ by more than it."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from eyas.store import ObjectStore

ROOT = "promotion"


class RollbackError(ValueError):
    """Nothing to roll back to."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    why: str
    margin: float | None  # how far the candidate had to beat the current τ


def decide(candidate_tau: float | None, current_tau: float | None) -> Decision:
    """Promote only when the candidate's τ beats the current drafter's, on the same prompts, by more than the
    diagnosis's significance margin at the current τ; a current drafter that could not be scored (it drafts for
    another target) is replaced by any candidate that was."""
    from services.evaluator.diagnose import significant

    if candidate_tau is None:
        return Decision(False, "the candidate was not scored", None)
    if current_tau is None:
        return Decision(True, "the current drafter could not be scored on the target served now", None)
    margin = significant(current_tau)
    gain = candidate_tau - current_tau
    if gain > margin:
        return Decision(True, f"τ {candidate_tau:.3f} beats {current_tau:.3f} by {gain:+.3f} > {margin:.3f}", margin)
    return Decision(False, f"τ {candidate_tau:.3f} against {current_tau:.3f}: {gain:+.3f} is not more than the "
                           f"significance margin {margin:.3f}", margin)


def stamp(now: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if now is None else now, UTC).strftime("%Y%m%dT%H%M%S.%f")


@dataclass
class Promotions:
    store: ObjectStore
    name: str

    @property
    def _current_key(self) -> str:
        return f"{ROOT}/{self.name}/current.json"

    def current(self) -> dict[str, Any] | None:
        """{"drafter", "tau", "k", "record", "previous": [...]}, or None before the first promotion."""
        if not self.store.exists(self._current_key):
            return None
        return json.loads(self.store.get_bytes(self._current_key))

    def history(self) -> list[dict[str, Any]]:
        keys = sorted(self.store.list(f"{ROOT}/{self.name}/history"))
        return [json.loads(self.store.get_bytes(k)) for k in keys]

    def _put_record(self, record: dict[str, Any]) -> str:
        key = f"{ROOT}/{self.name}/history/{stamp()}-{record['kind']}.json"
        self.store.put_bytes(key, json.dumps(record, indent=1).encode())
        return key

    def record(self, record: dict[str, Any]) -> str:
        """Store a refresh's record; when it promoted, its candidate becomes current, the drafter it replaces
        joins the previous ones. The record's key."""
        key = self._put_record(record)
        if record["promoted"]:
            before = self.current() or {"drafter": record["current"]["drafter"], "tau": record["current"]["tau"],
                                        "k": record["k"], "record": None, "previous": []}
            previous = [*before.pop("previous"), before]
            self._put_current({"drafter": record["candidate"]["drafter"], "tau": record["candidate"]["tau"],
                               "k": record["k"], "record": key, "previous": previous})
        return key

    def rollback(self) -> dict[str, Any]:
        """The drafter current before the last promotion is current again (its τ and record with it); the rollback
        record."""
        now = self.current()
        if not now or not now["previous"]:
            raise RollbackError(f"promotion line {self.name!r}: no earlier drafter to roll back to")
        *rest, back = now["previous"]
        self._put_current({**back, "previous": rest})
        record = {"kind": "rollback", "at": time.time(), "from": now["drafter"], "to": back["drafter"],
                  "tau": back["tau"]}
        record["key"] = self._put_record(record)
        return record

    def _put_current(self, current: dict[str, Any]) -> None:
        self.store.put_bytes(self._current_key, json.dumps(current, indent=1).encode())


def promoted(store: ObjectStore, drafter_uri: str) -> dict[str, Any] | None:
    """The current.json of the promotion line whose current drafter is `drafter_uri` (newest promotion first), if
    any: the watch's baseline."""
    found = []
    for key in store.list(ROOT):
        if key.endswith("/current.json") and key.count("/") == 2:
            current = json.loads(store.get_bytes(key))
            if current.get("drafter") == drafter_uri and current.get("tau") is not None:
                found.append(current)
    return max(found, key=lambda c: c.get("record") or "") if found else None

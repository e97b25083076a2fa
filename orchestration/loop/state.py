"""What the loop keeps of its own in the store, per promotion line NAME: loop/NAME/state.json, the last refresh it
began — from which drafter, when, and, once it ended, how (promoted, not promoted, failed) and why. The refreshes
themselves are the line's promotion records (orchestration.refresh.promotion)."""
from __future__ import annotations

import json
from typing import Any

from eyas.store import ObjectStore


def _key(name: str) -> str:
    return f"loop/{name}/state.json"


def loop_state(store: ObjectStore, name: str) -> dict[str, Any] | None:
    """{"drafter", "began"} and, once the refresh ended, "ended", "outcome", "why" and the promotion record's
    "record" key; None before the loop's first refresh."""
    return json.loads(store.get_bytes(_key(name))) if store.exists(_key(name)) else None


def put_loop_state(store: ObjectStore, name: str, state: dict[str, Any]) -> None:
    store.put_bytes(_key(name), json.dumps(state, indent=1).encode())

"""The refresh's data: the recent recorded windows (as `eyas proxy` and `eyas traffic import` write them), their
prompts deduplicated by the one "same prompt" rule (eyas.neardup), a held-out slice chosen by a hash of each
prompt's text, and a draw weighted toward the prompts the current drafter accepts least."""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from eyas.neardup import NearDupIndex, normalize
from eyas.store import ObjectStore
from orchestration.proxy.recorder import STAMP


@dataclass
class Recent:
    records: list[dict]  # messages-JSONL records, one per distinct first user turn, oldest window first
    windows: list[str]  # the window objects' keys read
    read: int  # records read before deduplication


def first_user(record: dict) -> str:
    return next(m["content"] for m in record["messages"] if m["role"] == "user")


def read_recent(store: ObjectStore, prefix: str, since_hours: float, now: float) -> Recent:
    """The records of the windows that started at most `since_hours` before `now`, deduplicated (the first of
    near-duplicates kept)."""
    cutoff = datetime.fromtimestamp(now, UTC) - timedelta(hours=since_hours)
    windows = []
    for key in store.list(prefix):
        name = key[len(prefix) + 1:]
        try:
            start = datetime.strptime(name[:15], STAMP).replace(tzinfo=UTC)
        except ValueError:
            continue  # not a window
        if "/" not in name and name.endswith(".jsonl") and start >= cutoff:
            windows.append((start, key))
    seen, records, read = NearDupIndex(), [], 0
    for _, key in sorted(windows):
        for line in store.get_bytes(key).decode().splitlines():
            if not line.strip():
                continue
            record, read = json.loads(line), read + 1
            if seen.find(first_user(record)) is None:
                seen.add(first_user(record))
                records.append(record)
    return Recent(records, [key for _, key in sorted(windows)], read)


def text_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(normalize(text).encode()).digest()[:8], "big")


def split_heldout(records: list[dict], share: float, least: int, most: int) -> tuple[list[dict], list[dict]]:
    """(held out, the rest): the prompts with the lowest hashes of their text, `share` of them (within [least,
    most], and never all of them). The same prompt is held out again in a later refresh, where the lowest hashes
    stay the lowest."""
    n = min(max(least, round(share * len(records))), most, max(0, len(records) - 1))
    order = sorted(records, key=lambda r: text_hash(first_user(r)))
    return order[:n], order[n:]


SMOOTH = 0.25  # accepted tokens per draft added before the inverse: a prompt accepting nothing weighs 1 / SMOOTH


def low_acceptance_weight(tau: float | None) -> float:
    """A prompt's weight in the draw: the inverse of the tokens its drafts accept, 1 / (τ − 1 + SMOOTH), so a prompt
    the drafter accepts nothing on weighs 4, one at τ 1.3 about 1.8, one at τ 3 under 0.5 (never 0: every prompt can
    be drawn); an unscored prompt (no drafts) weighs as one accepting nothing."""
    return 1 / ((0.0 if tau is None else max(tau - 1, 0.0)) + SMOOTH)


def weighted_draw(records: list[dict], weights: list[float], n: int, seed: int) -> list[dict]:
    """`n` records without replacement, each drawn with probability in proportion to its weight (Efraimidis–
    Spirakis keys u^(1/w)); all of them when n is not less."""
    if n >= len(records):
        return list(records)
    rng = random.Random(seed)
    keys = [math.log(rng.random() or 1e-300) / w for w in weights]
    chosen = sorted(range(len(records)), key=lambda i: keys[i], reverse=True)[:n]
    return [records[i] for i in sorted(chosen)]

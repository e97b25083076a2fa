"""The generator's journal: finished samples committed in small atomic parts, the source of resume."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

from eyas.store import Artifact


class Journal:
    """Finished samples, committed in small atomic parts under the output prefix: the source of resume and of the
    final shards (every worker sharing a job journals here). A rerun (or a redelivered task) reads them and
    regenerates none; kill -9 loses only unflushed samples, which are regenerated, so nothing is lost and nothing
    is written twice into the final shards. Dead letters are committed at once, in parts of their own.
    `on_commit(ids)` is told which prompts each commit made durable."""

    def __init__(self, artifact: Artifact, flush_every: int = 8, flush_s: float = 5.0,
                 on_commit: Callable[[list[str]], None] = lambda ids: None):
        self.artifact, self.flush_every, self.flush_s, self.on_commit = artifact, flush_every, flush_s, on_commit
        self.buffer: list[dict] = []
        self._last = time.monotonic()

    def _read(self, prefix: str) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for name in sorted(n for n in self.artifact.names() if n.startswith(prefix)):
            for line in self.artifact.get_bytes(name).decode().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    out.setdefault(rec["id"], rec)
        return out

    def load(self) -> dict[str, dict]:
        """Finished samples by prompt id (the first journaled, if a prompt was ever generated twice)."""
        return self._read("parts/part-")

    def load_dead(self) -> dict[str, dict]:
        return self._read("parts/dead-")

    def add_dead(self, record: dict) -> None:
        self.artifact.put_bytes(f"parts/dead-{time.time_ns()}-{uuid.uuid4().hex[:6]}.jsonl",
                                (json.dumps(record) + "\n").encode())
        self.on_commit([record["id"]])

    def add(self, record: dict) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.flush_every or time.monotonic() - self._last > self.flush_s:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.buffer).encode()
            self.artifact.put_bytes(f"parts/part-{time.time_ns()}-{uuid.uuid4().hex[:6]}.jsonl", body)
            ids = [r["id"] for r in self.buffer]
            self.buffer = []
            self.on_commit(ids)
        self._last = time.monotonic()

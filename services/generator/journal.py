"""The generator's journal: finished samples committed in small atomic parts, the source of resume."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from eyas.store import Artifact


class Journal:
    """Finished samples, committed in small atomic parts under the output prefix: the source of resume and of the
    final shards (every worker sharing a job journals here). A rerun (or a redelivered task) reads them and
    regenerates none; kill -9 loses only unflushed samples, which are regenerated, so nothing is lost and nothing
    is written twice into the final shards. Dead letters are committed at once, in parts of their own.
    `on_commit(ids)` is told which prompts each commit made durable (never before).

    A full buffer is written by a thread of its own (group commit): the event loop goes on while the part is
    written and synced, and samples that finish meanwhile wait for the next part, so at hundreds of samples a
    second parts grow instead of each blocking the loop for an fsync (and a one-sample part per worker at the end;
    the profile: bench/README.md § Generator under load). `flush()` commits everything, waiting for a part in flight;
    `await commit()` too, without
    blocking the event loop."""

    def __init__(self, artifact: Artifact, flush_every: int = 8, flush_s: float = 5.0,
                 on_commit: Callable[[list[str]], None] = lambda ids: None):
        self.artifact, self.flush_every, self.flush_s, self.on_commit = artifact, flush_every, flush_s, on_commit
        self.buffer: list[dict] = []
        self._last = time.monotonic()
        self._writer: ThreadPoolExecutor | None = None
        self._writing: tuple[Future, list[str]] | None = None  # the part in flight, and its prompts
        self._added = self._committed = 0  # samples

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
        self._added += 1
        self._written(wait=False)
        if self._writing is None and (len(self.buffer) >= self.flush_every or
                                      time.monotonic() - self._last > self.flush_s):
            self._start()

    def _start(self) -> None:
        """The buffer as a part, written by the journal's thread."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="journal")
        body, ids = self._part()
        self._writing = (self._writer.submit(self._put, body), ids)
        self._last = time.monotonic()

    async def commit(self) -> None:
        """Everything added until now committed, as flush() does, while the event loop goes on."""
        target = self._added
        while self._committed < target:
            if self._writing is None:
                if not self.buffer:  # what is missing was in a part whose write failed (raised where it was seen)
                    raise RuntimeError("a journal part could not be written")
                self._start()
            fut = self._writing[0]
            await asyncio.shield(asyncio.wrap_future(fut))  # a cancelled caller leaves the write to finish
            if self._writing is not None and self._writing[0] is fut:  # else another caller took it
                self._written(wait=True)

    def _part(self) -> tuple[bytes, list[str]]:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.buffer).encode()
        ids = [r["id"] for r in self.buffer]
        self.buffer = []
        return body, ids

    def _put(self, body: bytes) -> None:
        self.artifact.put_bytes(f"parts/part-{time.time_ns()}-{uuid.uuid4().hex[:6]}.jsonl", body)

    def _written(self, wait: bool) -> None:
        """Once the part in flight is committed (at once with `wait`): tell on_commit (a failed write raises)."""
        if self._writing is not None and (wait or self._writing[0].done()):
            fut, ids = self._writing
            self._writing = None
            fut.result()
            self._committed += len(ids)
            self.on_commit(ids)

    def flush(self) -> None:
        self._written(wait=True)
        if self.buffer:
            body, ids = self._part()
            self._put(body)
            self._committed += len(ids)
            self.on_commit(ids)
        self._last = time.monotonic()

"""A run's work shared among the workers of its stage by tasks: the ids are cut into chunks, and every chunk but the
last goes to the stage's queue as a task of its own (orchestration.tasks.assist_job), so any free worker helps,
and a worker started mid-run joins by taking the next chunk. The run itself works the chunks too, last first,
and meets the helpers in the middle.

A chunk is worked by whoever holds its lease (orchestration.lease). Finished ids (committed by the stage: journaled
or dead-lettered) go in one set per run, so whoever takes a chunk over skips what is already done. A helper that
dies stops renewing its lease; the run takes the chunk over once the lease lapses, and waits for the chunks others
hold before it commits. A chunk task whose chunk is done, held, or of an earlier run of the job does nothing.

Ordered work (a features stream's shards, whose later items wait on the earlier ones being done) is shared id by
id instead: every id is a chunk of its own, every participant knows them all and takes the first free one, so the
earliest unfinished id is always held by a live participant or free for the next to take. Each helper's task names
every id (chunk index ORDERED).

Keys carry the run's attempt number and expire a day after the run's last commit (the run deletes them when done),
so a run whose workers all died leaves nothing behind for long.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import redis

from eyas.coordination import LocalWork, Work
from orchestration.lease import Lease, Leases

log = logging.getLogger(__name__)

KEY_TTL_S = 86_400
# (stage, job_id, attempt, chunk index, ids) → a chunk task on the stage's queue
SendChunk = Callable[[str, str, int, int, list[str]], None]
ORDERED = -1  # the chunk index of a helper's task for ordered work: its ids are all the run's, one chunk each


def cut_chunks(ids: list[str], helpers: int, min_chunk: int) -> list[list[str]]:
    """About two chunks per participant (the run and its helpers), each of at least `min_chunk` ids: enough to
    balance a helper that joins late against one that started first, few enough that the queue carries few."""
    size = max(1, min_chunk, math.ceil(len(ids) / (2 * (helpers + 1))))
    return [ids[i:i + size] for i in range(0, len(ids), size)]


class ChunkWork:
    """eyas.coordination.Work over chunks held under leases (see the module doc). The run's own (`owner`) knows
    every chunk and tries them last first; a helper knows the one chunk its task names. Ordered work: one id per
    chunk, every participant knows them all and tries them first first."""

    def __init__(self, client: redis.Redis, leases: Leases, job_id: str, attempt: int,
                 chunks: dict[int, list[str]], owner: bool, ordered: bool = False):
        self.r, self.leases, self.owner = client, leases, owner
        self.base = f"eyas:work:{job_id}:{attempt}"
        self.finished_key, self.stats_key = f"{self.base}:finished", f"{self.base}:stats"
        self.chunks = chunks
        self.total = sum(len(c) for c in chunks.values())
        self._order = sorted(chunks, reverse=not ordered)
        self._complete: set[int] = set()
        self._held: dict[int, tuple[Lease, set[str]]] = {}  # chunk → its lease, its ids not yet finished
        self._next: deque[str] = deque()  # ids of held chunks not yet handed out

    def _take(self, index: int) -> bool:
        """Hold chunk `index` and queue its unfinished ids; False when someone holds it or it is done."""
        lease = self.leases.try_hold(f"{self.base}:chunk:{index}")
        if lease is None:
            return False
        ids = self.chunks[index]
        todo = [i for i, done in zip(ids, self.r.smismember(self.finished_key, ids), strict=True) if not done]
        if not todo:
            lease.release()
            self._complete.add(index)
            return False
        self._held[index] = (lease, set(todo))
        self._next.extend(todo)
        return True

    def claim(self) -> str | None:
        while not self._next:
            free = [i for i in self._order if i not in self._complete and i not in self._held]
            if not any(self._take(i) for i in free):  # any(): stops at the first chunk taken
                return None
        return self._next.popleft()

    def finished(self, ids: list[str]) -> None:
        if not ids:
            return
        with self.r.pipeline() as p:
            p.sadd(self.finished_key, *ids)
            p.expire(self.finished_key, KEY_TTL_S)
            p.execute()
        for index, (lease, todo) in list(self._held.items()):
            todo.difference_update(ids)
            if not todo:
                lease.release()
                del self._held[index]
                self._complete.add(index)

    def open_count(self) -> int:
        return self.total - self.finished_count() if self.owner else 0

    def finished_count(self) -> int:
        return int(self.r.scard(self.finished_key))

    def add_stats(self, stats: dict[str, int]) -> None:
        with self.r.pipeline() as p:
            for k, v in stats.items():
                p.hincrby(self.stats_key, k, int(v))
            p.expire(self.stats_key, KEY_TTL_S)
            p.execute()

    def shared_stats(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.stats_key).items()}

    def close(self) -> None:
        for lease, _ in self._held.values():
            lease.release()
        self._held.clear()
        if self.owner:  # everything is committed (or the run gave up): helpers of this run find nothing to do
            self.r.delete(self.finished_key, self.stats_key)


def ordered_chunks(ids: list[str]) -> dict[int, list[str]]:
    return {i: [id_] for i, id_ in enumerate(ids)}


def share_by_tasks(client: redis.Redis, leases: Leases, send: SendChunk, stage: str, job_id: str, attempt: int,
                   ids: list[str], helpers: int, min_chunk: int, ordered: bool = False) -> Work:
    """The run's Work: chunks on the stage's queue when there are helpers to share with and two chunks or more
    (ordered: a task naming every id for each helper)."""
    if ordered:
        if helpers <= 0 or len(ids) < 2:
            return LocalWork(ids)
        work = ChunkWork(client, leases, job_id, attempt, ordered_chunks(ids), owner=True, ordered=True)
        for _ in range(helpers):
            send(stage, job_id, attempt, ORDERED, ids)
        log.info("job %s: %d ordered ids shared with up to %d helpers on the %s queue", job_id, len(ids), helpers,
                 stage)
        return work
    chunks = cut_chunks(ids, helpers, min_chunk) if helpers > 0 else []
    if len(chunks) < 2:
        return LocalWork(ids)
    work = ChunkWork(client, leases, job_id, attempt, dict(enumerate(chunks)), owner=True)
    for index, chunk in enumerate(chunks[:-1]):  # the last is the run's own first
        send(stage, job_id, attempt, index, chunk)
    log.info("job %s: %d ids in %d chunks, %d of them on the %s queue", job_id, len(ids), len(chunks),
             len(chunks) - 1, stage)
    return work

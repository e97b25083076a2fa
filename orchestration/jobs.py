"""Job records and their state machine: queued → running → succeeded | failed | cancelled.

Two backends with one interface: SQLite (embedded mode) and Redis (service mode, shared by APIs and workers).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

State = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
ALLOWED: dict[str, frozenset[str]] = {
    "queued": frozenset({"running", "failed", "cancelled"}),
    # running → running: a redelivered task picks the job up again after its worker died
    "running": frozenset({"running", "succeeded", "failed", "cancelled"}),
    "succeeded": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class JobNotFound(KeyError):
    pass


class Progress(BaseModel):
    done: int = 0
    total: int = 0
    unit: str = ""


class JobRecord(BaseModel):
    id: str
    stage: str
    state: State = "queued"
    spec: dict[str, Any]
    progress: Progress = Field(default_factory=Progress)
    metrics: dict[str, Any] = {}
    artifacts: dict[str, str] = {}  # name → URI
    error: str | None = None
    parent: str | None = None  # the job whose artifact this one consumes
    next_job: str | None = None  # the job enqueued after this one succeeded
    cancel_requested: bool = False
    attempts: int = 0
    worker: str | None = None  # the process that runs it, or ran it last (host:pid)
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


def _job_id(stage: str, key: str) -> str:
    """The job-id scheme: the stage's first three letters, then a key the stages of one pipeline share."""
    return f"{stage[:3]}-{key}"


def new_job_id(stage: str) -> str:
    return _job_id(stage, uuid.uuid4().hex[:12])


def next_job_id(job_id: str, stage: str) -> str:
    """The id of the `stage` job that follows `job_id` in its pipeline: derived from it, so a redelivered task
    never enqueues the next stage twice."""
    return _job_id(stage, job_id.split("-", 1)[1])


class JobStore(Protocol):
    def put(self, job: JobRecord) -> None: ...
    def get(self, job_id: str) -> JobRecord: ...
    def mutate(self, job_id: str, change: Callable[[JobRecord], JobRecord]) -> JobRecord: ...
    def list(self, stage: str | None = None, limit: int = 100, state: str | None = None) -> list[JobRecord]: ...
    def counts(self) -> dict[tuple[str, str], int]: ...
    def ping(self) -> None: ...


def _changed(job: JobRecord, fields: dict[str, Any]) -> JobRecord:
    return JobRecord.model_validate({**job.model_dump(), **fields, "updated_at": time.time()})


def transition(store: JobStore, job_id: str, state: State, **fields: Any) -> JobRecord:
    """Move a job to `state`, refusing moves the state machine does not allow. Atomic (read-check-write in one
    step), so a worker's progress write and an API's cancel never overwrite each other."""

    def change(job: JobRecord) -> JobRecord:
        if state not in ALLOWED[job.state]:
            raise IllegalTransition(f"job {job_id}: {job.state} → {state} is not allowed")
        return _changed(job, {**fields, "state": state})

    return store.mutate(job_id, change)


def update(store: JobStore, job_id: str, **fields: Any) -> JobRecord:
    return store.mutate(job_id, lambda job: _changed(job, fields))


class AlreadyEnded(RuntimeError):
    """A cancel asked of a job that has already succeeded, failed or been cancelled."""


def request_cancel(store: JobStore, job_id: str) -> JobRecord:
    """Cancel a job: a queued one is cancelled at once; a running one is marked, and its run, which watches the
    mark (orchestration.cancel_watch), stops its stage at the stage's next step (eyas.stage.StageContext.check).
    Raises AlreadyEnded for a job that has ended."""
    job = store.get(job_id)
    if job.state == "queued":
        try:
            return transition(store, job_id, "cancelled", cancel_requested=True, error="cancelled before it started")
        except IllegalTransition:  # a worker started it meanwhile
            job = store.get(job_id)
    if job.state in TERMINAL:
        raise AlreadyEnded(f"job {job_id} has already ended ({job.state})")
    return update(store, job_id, cancel_requested=True)


class SqliteJobStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, stage TEXT, created REAL, body TEXT)"
        )

    def _write(self, job: JobRecord) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO jobs (id, stage, created, body) VALUES (?, ?, ?, ?)",
            (job.id, job.stage, job.created_at, job.model_dump_json()),
        )

    def _read(self, job_id: str) -> JobRecord:
        row = self._db.execute("SELECT body FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate_json(row[0])

    def put(self, job: JobRecord) -> None:
        with self._lock:
            self._write(job)

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            return self._read(job_id)

    def mutate(self, job_id: str, change: Callable[[JobRecord], JobRecord]) -> JobRecord:
        with self._lock:  # threads of this process; BEGIN IMMEDIATE: other processes on the same file
            self._db.execute("BEGIN IMMEDIATE")
            try:
                job = change(self._read(job_id))
                self._write(job)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return job

    def list(self, stage: str | None = None, limit: int = 100, state: str | None = None) -> list[JobRecord]:
        where, args = [], []
        if stage:
            where.append("stage = ?")
            args.append(stage)
        if state:
            where.append("json_extract(body, '$.state') = ?")
            args.append(state)
        q = "SELECT body FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created DESC LIMIT ?", (*args, limit)).fetchall()
        return [JobRecord.model_validate_json(r[0]) for r in rows]

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT stage, json_extract(body, '$.state'), COUNT(*) FROM jobs GROUP BY 1, 2").fetchall()
        return {(stage, state): n for stage, state, n in rows}

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1")


class RedisJobStore:
    def __init__(self, url: str, namespace: str = "eyas"):
        import redis

        self.r = redis.Redis.from_url(url)
        self.ns = namespace

    def _write(self, pipe, job: JobRecord) -> None:
        pipe.set(f"{self.ns}:job:{job.id}", job.model_dump_json())
        pipe.zadd(f"{self.ns}:jobs:{job.stage}", {job.id: job.created_at})
        pipe.zadd(f"{self.ns}:jobs", {job.id: job.created_at})
        pipe.hset(f"{self.ns}:states", job.id, f"{job.stage}:{job.state}")  # for counts()

    def put(self, job: JobRecord) -> None:
        pipe = self.r.pipeline()
        self._write(pipe, job)
        pipe.execute()

    def get(self, job_id: str) -> JobRecord:
        raw = self.r.get(f"{self.ns}:job:{job_id}")
        if raw is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate(json.loads(raw))

    def mutate(self, job_id: str, change: Callable[[JobRecord], JobRecord]) -> JobRecord:
        import redis

        key = f"{self.ns}:job:{job_id}"
        with self.r.pipeline() as pipe:
            while True:  # optimistic: retry if another process wrote the job between our read and write
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        raise JobNotFound(job_id)
                    job = change(JobRecord.model_validate(json.loads(raw)))
                    pipe.multi()
                    self._write(pipe, job)
                    pipe.execute()
                    return job
                except redis.WatchError:
                    continue

    def list(self, stage: str | None = None, limit: int = 100, state: str | None = None) -> list[JobRecord]:
        key = f"{self.ns}:jobs:{stage}" if stage else f"{self.ns}:jobs"
        out: list[JobRecord] = []
        start, page = 0, max(limit, 100)
        while len(out) < limit:
            ids = [i.decode() for i in self.r.zrevrange(key, start, start + page - 1)]
            if not ids:
                break
            out += [j for j in map(self.get, ids) if state is None or j.state == state]
            start += page
        return out[:limit]

    def counts(self) -> dict[tuple[str, str], int]:
        return dict(Counter(tuple(v.decode().split(":", 1)) for v in self.r.hvals(f"{self.ns}:states")))

    def ping(self) -> None:
        self.r.ping()

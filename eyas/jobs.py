"""Job records and their state machine: queued → running → succeeded | failed | cancelled.

Two backends with one interface: SQLite (embedded mode) and Redis (service mode, shared by APIs and workers).
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
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
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)


def new_job_id(stage: str) -> str:
    return f"{stage[:3]}-{uuid.uuid4().hex[:12]}"


class JobStore(Protocol):
    def put(self, job: JobRecord) -> None: ...
    def get(self, job_id: str) -> JobRecord: ...
    def list(self, stage: str | None = None, limit: int = 100) -> list[JobRecord]: ...
    def ping(self) -> None: ...


def transition(store: JobStore, job_id: str, state: State, **fields: Any) -> JobRecord:
    """Move a job to `state`, refusing moves the state machine does not allow."""
    job = store.get(job_id)
    if state not in ALLOWED[job.state]:
        raise IllegalTransition(f"job {job_id}: {job.state} → {state} is not allowed")
    job = job.model_copy(update={"state": state, "updated_at": time.time(), **fields})
    store.put(job)
    return job


def update(store: JobStore, job_id: str, **fields: Any) -> JobRecord:
    job = store.get(job_id).model_copy(update={"updated_at": time.time(), **fields})
    store.put(job)
    return job


class SqliteJobStore:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, stage TEXT, created REAL, body TEXT)"
        )

    def put(self, job: JobRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO jobs (id, stage, created, body) VALUES (?, ?, ?, ?)",
                (job.id, job.stage, job.created_at, job.model_dump_json()),
            )

    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            row = self._db.execute("SELECT body FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate_json(row[0])

    def list(self, stage: str | None = None, limit: int = 100) -> list[JobRecord]:
        q, args = "SELECT body FROM jobs", ()
        if stage:
            q, args = q + " WHERE stage = ?", (stage,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created DESC LIMIT ?", (*args, limit)).fetchall()
        return [JobRecord.model_validate_json(r[0]) for r in rows]

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1")


class RedisJobStore:
    def __init__(self, url: str, namespace: str = "eyas"):
        import redis

        self.r = redis.Redis.from_url(url)
        self.ns = namespace

    def put(self, job: JobRecord) -> None:
        pipe = self.r.pipeline()
        pipe.set(f"{self.ns}:job:{job.id}", job.model_dump_json())
        pipe.zadd(f"{self.ns}:jobs:{job.stage}", {job.id: job.created_at})
        pipe.zadd(f"{self.ns}:jobs", {job.id: job.created_at})
        pipe.execute()

    def get(self, job_id: str) -> JobRecord:
        raw = self.r.get(f"{self.ns}:job:{job_id}")
        if raw is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate(json.loads(raw))

    def list(self, stage: str | None = None, limit: int = 100) -> list[JobRecord]:
        key = f"{self.ns}:jobs:{stage}" if stage else f"{self.ns}:jobs"
        ids = [i.decode() for i in self.r.zrevrange(key, 0, limit - 1)]
        return [self.get(i) for i in ids]

    def ping(self) -> None:
        self.r.ping()

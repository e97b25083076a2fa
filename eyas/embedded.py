"""Embedded mode: local directory store, SQLite job records, tasks run in-process (no Redis, no S3 server).

`run_job` is what `eyas run` and every `eyas <stage>` CLI command call: it submits through the same
`eyas.pipeline` code path the services use, and executes each stage (and the stages of `then`) inline.
"""
from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from eyas.jobs import JobRecord, SqliteJobStore
from eyas.pipeline import execute, submit
from eyas.settings import Settings, get_settings
from eyas.store import Artifact, LocalStore


class Embedded:
    def __init__(self, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self.settings.workdir.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(self.settings.store_root)
        self.jobs = SqliteJobStore(self.settings.workdir / "jobs.sqlite")
        self._queue: deque[str] = deque()

    def _dispatch(self, _stage: str, job_id: str) -> None:
        self._queue.append(job_id)

    def run_job(self, stage: str, spec: dict[str, Any], output_dir: Path | None = None) -> list[JobRecord]:
        """Submit a job and run it and its `then` stages to the end; returns every job record, in order.
        `output_dir` puts the first job's artifact in that directory instead of the workdir store."""
        first = submit(stage, spec, self.jobs, self._dispatch)
        done: list[JobRecord] = []
        while self._queue:
            job_id = self._queue.popleft()
            output = Artifact(LocalStore(output_dir)) if output_dir and job_id == first.id else None
            done.append(execute(job_id, self.jobs, self.store, self.settings, self._dispatch, output=output))
        return done or [self.jobs.get(first.id)]

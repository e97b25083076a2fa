"""Embedded mode: local directory store, SQLite job records, tasks run in-process (no Redis, no S3 server).

`run_job` is what `eyas run` and every `eyas <stage>` CLI command call: it submits through the same
`orchestration.execution` code path the services use, and executes each stage (and the stages of `then`) inline.
What a command line may read: the workdir, EYAS_INPUT_ROOTS, and the files and directories its user names
(`command_line_settings`).
"""
from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from eyas.confine import Names, visit
from eyas.settings import Settings, get_settings
from eyas.store import Artifact, LocalStore
from orchestration.execution import execute, submit
from orchestration.jobs import JobRecord, SqliteJobStore
from orchestration.registry import get_stage, step_model


def command_line_settings(stage: str, spec: dict[str, Any], workdir: Path | None) -> Settings:
    """Settings for a command line's job: each local path the spec names (its `then` entries too) becomes
    absolute, in `spec`, and an input root — the user named it, so the job may read it."""
    named: list[Path] = []

    def local(_field: str, value: str, marker: Names) -> str:
        if value in marker.exact or marker.what == "endpoint" or value.startswith("s3://"):
            return value
        if value.startswith("file://"):
            named.append(Path(unquote(value[len("file://"):])))
            return value
        named.append(Path(os.path.abspath(value)))
        return str(named[-1])

    visit(get_stage(stage).spec_cls, spec, local)
    for step in spec.get("then", []):
        if isinstance(step, dict) and isinstance(step.get("stage"), str):
            visit(step_model(step["stage"]), step, local)
    settings = Settings(workdir=workdir) if workdir else Settings()
    return settings.model_copy(update={"input_roots": [*settings.input_roots, *named]})


class EmbeddedRunner:
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
        first = submit(stage, spec, self.jobs, self._dispatch, self.settings)
        done: list[JobRecord] = []
        while self._queue:
            job_id = self._queue.popleft()
            output = Artifact(LocalStore(output_dir)) if output_dir and job_id == first.id else None
            done.append(execute(job_id, self.jobs, self.store, self.settings, self._dispatch, output=output))
        return done or [self.jobs.get(first.id)]

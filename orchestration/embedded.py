"""Embedded mode: local directory store, SQLite job records, tasks run in-process (no Redis, no S3 server).

`run_job` is what `eyas run` and every `eyas <stage>` CLI command call: it submits through the same
`orchestration.execution` code path the services use, and executes each stage (and the stages of `then`) inline,
one after the other; a stage handed its input while the stage before still writes it runs beside that one.
What a command line may read: the workdir, EYAS_INPUT_ROOTS, and the files and directories its user names
(`command_line_settings`).
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from eyas.confine import Names, visit
from eyas.settings import Settings
from eyas.store import Artifact, LocalStore
from orchestration.execution import execute, runs_beside_parent, submit
from orchestration.jobs import JobRecord, SqliteJobStore
from orchestration.registry import get_stage, step_model
from orchestration.settings import ServiceSettings, get_service_settings

log = logging.getLogger(__name__)


def command_line_settings(stage: str, spec: dict[str, Any], workdir: Path | None) -> ServiceSettings:
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
    settings = ServiceSettings(workdir=workdir) if workdir else ServiceSettings()
    return settings.model_copy(update={"input_roots": [*settings.input_roots, *named]})


class EmbeddedRunner:
    def __init__(self, settings: Settings | None = None):
        self.settings = ServiceSettings.of(settings) if settings else get_service_settings()
        self.settings.workdir.mkdir(parents=True, exist_ok=True)
        self.store = LocalStore(self.settings.store_root)
        self.jobs = SqliteJobStore(self.settings.workdir / "jobs.sqlite")

    def run_job(self, stage: str, spec: dict[str, Any], output_dir: Path | None = None) -> list[JobRecord]:
        """Submit a job and run it and its `then` stages to the end; returns every job record, in the order the jobs
        were dispatched. Each job runs on this thread after the one before it, except one whose parent hands off
        early (eyas.stage.StageSpec.hands_off_early): that one runs beside its parent, in a thread of its own. A
        job's exception is raised again once every job has ended. `output_dir` puts the first job's artifact in that
        directory instead of the workdir store."""
        run = _Run(self, Artifact(LocalStore(output_dir)) if output_dir else None)
        submit(stage, spec, self.jobs, run.dispatch, self.settings)
        return run.wait()


class _Run:
    """The jobs of one `run_job`: those queued for the caller's thread, and those running beside them."""

    def __init__(self, runner: EmbeddedRunner, first_output: Artifact | None):
        self.runner, self.first_output = runner, first_output
        # `dispatch` is called from any job's thread: the condition guards what follows, and is notified when a job
        # is queued or one running beside ends
        self.changed = threading.Condition()
        self.dispatched: list[str] = []
        self.queued: deque[str] = deque()
        self.beside = 0  # jobs running in threads of their own
        self.raised: dict[str, Exception] = {}

    def dispatch(self, _stage: str, job_id: str) -> None:
        beside = runs_beside_parent(self.runner.jobs, job_id, self.runner.settings)
        with self.changed:
            self.dispatched.append(job_id)
            if beside:
                self.beside += 1
            else:
                self.queued.append(job_id)
                self.changed.notify_all()
        if beside:
            # a daemon: an interrupted run (Ctrl-C on the caller's thread) does not wait for it
            threading.Thread(target=self._run_beside, args=(job_id,), name=f"eyas-{job_id}", daemon=True).start()

    def wait(self) -> list[JobRecord]:
        """Run the queued jobs on this thread until none is queued and none runs beside; every record, in dispatch
        order, or the first dispatched job's exception (the others' are logged and on their records)."""
        while (job_id := self._next_queued()) is not None:
            self._execute(job_id)
        if self.raised:
            first, *others = (j for j in self.dispatched if j in self.raised)
            for other in others:
                log.error("job %s also failed: %r", other, self.raised[other])
            raise self.raised[first]
        return [self.runner.jobs.get(job_id) for job_id in self.dispatched]

    def _next_queued(self) -> str | None:
        with self.changed:
            self.changed.wait_for(lambda: self.queued or not self.beside)
            return self.queued.popleft() if self.queued else None

    def _execute(self, job_id: str) -> None:
        output = self.first_output if job_id == self.dispatched[0] else None
        r = self.runner
        try:
            execute(job_id, r.jobs, r.store, r.settings, self.dispatch, output=output)
        except Exception as e:  # on the job's record and in the log already (execute); raised once all jobs end
            with self.changed:
                self.raised[job_id] = e

    def _run_beside(self, job_id: str) -> None:
        try:
            self._execute(job_id)
        finally:
            with self.changed:
                self.beside -= 1
                self.changed.notify_all()

"""Submitting and executing jobs — the one code path behind the API, the Celery tasks, the CLI and `eyas run`.

submit():  validate a spec (confine it: eyas.confine; hold it to the operator's quotas: orchestration.quotas),
           create the job record (queued), hand it to the dispatcher.
execute(): run a job's stage, commit its artifact, record the result, and enqueue the next stage of `then` (as soon
           as the stage calls StageContext.hand_off instead, for a stage whose output is readable while written).
assist():  a helper's share of a running job's work (a chunk task of the service mode: orchestration.workshare).
A redelivered job (its worker died) runs again into the same deterministic prefix; an artifact whose manifest is
already committed there is reused, so it is written exactly once. A worker parses and confines a job's spec again
before it runs it (its own settings decide), so a record that reached the queue another way runs nothing it may
not. A failed job's record says why (`error`); the traceback goes to the worker's log only.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from eyas.confine import Refused, check_spec
from eyas.coordination import Work
from eyas.keys import safe_key
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.stage import Cancelled, StageContext, StageSpec
from eyas.store import Artifact, ObjectStore
from orchestration.cancel_watch import CancelWatch
from orchestration.coordination import Coordination, coordination_for
from orchestration.jobs import (
    TERMINAL,
    JobNotFound,
    JobRecord,
    JobStore,
    Progress,
    new_job_id,
    next_job_id,
    transition,
    update,
)
from orchestration.quotas import OverQuota, check_quotas, wall_time_error
from orchestration.registry import ARTIFACT_DIRS, get_stage, stages_after, step_model
from orchestration.settings import ServiceSettings

log = logging.getLogger(__name__)

Dispatch = Callable[[str, str], None]  # (stage, job_id) → schedules execute(job_id)


class SpecError(ValueError):
    """Bad job spec: `field` and `value` name what is wrong."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field}={value!r}: {message}")
        self.field, self.value, self.message = field, value, message


def _next_spec(step: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(step, str):
        return step, {}
    step = dict(step)
    return step.pop("stage"), step


def _non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """The first field holding NaN or ±Infinity, and its value (JSON has no such numbers; Python's parser takes
    them, and a free-form field would keep them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "body", value
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for field, item in items:
        if found := _non_finite(item, field):
            return found
    return None


def _parse(cls: type[BaseModel], spec: dict[str, Any], where: str = "") -> Any:
    try:
        return cls.model_validate(spec)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        raise SpecError(where + field if field else where.rstrip(".") or "body", err.get("input"),
                        err["msg"]) from None


def _confine(parsed: BaseModel, settings: Settings, where: str = "") -> None:
    try:
        check_spec(parsed, settings, where)
    except Refused as e:
        raise SpecError(e.field, e.value, e.rule) from None


def parse_spec(stage_name: str, spec: dict[str, Any], settings: Settings):
    """A stage's spec, parsed, and confined by these settings: every file, object and URL it names checked."""
    if bad := _non_finite(spec):
        raise SpecError(bad[0], str(bad[1]), "numbers must be finite (NaN and Infinity are refused)")
    parsed = _parse(get_stage(stage_name).spec_cls, spec)
    _confine(parsed, settings)
    return parsed


def _quotas(stage_name: str, parsed: BaseModel, settings: ServiceSettings, where: str = "") -> None:
    try:
        check_quotas(stage_name, parsed, settings, where)
    except OverQuota as e:
        raise SpecError(e.field, e.value, e.message) from None


def validate_spec(stage_name: str, spec: dict[str, Any], settings: Settings):
    """Parse and confine a spec for a stage, and every `then` entry too (each as its stage's spec without the
    input, which the stage before provides), then hold each to the operator's quotas (orchestration.quotas), so a
    pipeline fails at submit, not hours later."""
    settings = ServiceSettings.of(settings)
    parsed = parse_spec(stage_name, spec, settings)
    steps = [(stage_name, parsed, "")]
    prev = stage_name
    for i, step in enumerate(parsed.then):
        name = step if isinstance(step, str) else step.get("stage")
        expected = next(iter(stages_after(prev)), "none")
        if name != expected:
            raise SpecError(f"then[{i}]" if isinstance(step, str) else f"then[{i}].stage", name,
                            f"after {prev!r} the next stage must be {expected}")
        if isinstance(step, dict):
            _confine(entry := _parse(step_model(name), step, f"then[{i}]."), settings, f"then[{i}].")
        else:  # a bare name runs the stage's defaults
            entry = _parse(step_model(name), {"stage": name}, f"then[{i}].")
        steps.append((name, entry, f"then[{i}]."))
        prev = name
    for name, entry, where in steps:
        _quotas(name, entry, settings, where)
    return parsed


def submit(stage_name: str, spec: dict[str, Any], jobs: JobStore, dispatch: Dispatch, settings: Settings,
           parent: str | None = None, job_id: str | None = None) -> JobRecord:
    parsed = validate_spec(stage_name, spec, settings)
    job = JobRecord(id=job_id or new_job_id(stage_name), stage=stage_name, spec=parsed.model_dump(mode="json"),
                    parent=parent)
    jobs.put(job)
    dispatch(stage_name, job.id)
    return job


def job_output(store: ObjectStore, job: JobRecord) -> Artifact:
    """Where a job's artifact lives: {kind}/{job id}, the same for every run of the job and for its helpers."""
    return Artifact(store, safe_key(ARTIFACT_DIRS[job.stage], job.id))


class _WallTime:
    """The operator's wall-time cap on one run of a job (EYAS_MAX_JOB_MINUTES; none when unset): once the run is
    past it, `stop` is set, as a cancel sets it, and `passed()` says so."""

    def __init__(self, settings: ServiceSettings, stop: threading.Event):
        minutes = settings.max_job_minutes
        self.deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self._reached = threading.Event()
        self._timer = None
        if minutes is not None:
            self._timer = threading.Timer(60 * minutes, lambda: (self._reached.set(), stop.set()))
            self._timer.daemon = True
            self._timer.start()

    def passed(self) -> bool:
        return self._reached.is_set() or (self.deadline is not None and time.monotonic() >= self.deadline)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _job_reporter(jobs: JobStore, job_id: str, over_time: Callable[[], bool] = lambda: False):
    """The stage's progress sink: progress and live metrics go on the job record; says whether the stage must stop:
    a cancel came, or the run is `over_time` (the operator's wall-time cap)."""

    def report(done: int, total: int, unit: str, metrics: dict[str, Any]) -> bool:
        try:
            job = update(jobs, job_id, progress=Progress(done=done, total=total, unit=unit), metrics=metrics)
        except (RedisConnectionError, RedisTimeoutError) as e:
            # the job store away for longer than its client's retries (a Redis restart): progress is best-effort,
            # the stage goes on and its next report writes; the job's transitions are not written here
            log.warning("job %s: progress at %s/%s %s not recorded: %s", job_id, done, total, unit, e)
            return over_time()
        return job.cancel_requested or over_time()

    return report


def _stopped(jobs: JobStore, job_id: str, settings: ServiceSettings, wall: _WallTime, metrics: dict[str, Any],
             why: str) -> JobRecord:
    """The record of a run told to stop: failed at the operator's wall-time cap (unless a cancel came too), else
    cancelled."""
    if wall.passed() and not jobs.get(job_id).cancel_requested:
        log.warning("job %s: %s", job_id, wall_time_error(settings))
        return transition(jobs, job_id, "failed", error=wall_time_error(settings), metrics=metrics)
    return transition(jobs, job_id, "cancelled", error=why)


def this_worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def runs_beside_parent(jobs: JobStore, job_id: str, settings: Settings) -> bool:
    """Whether a job was handed its input while its parent still writes it (the parent's spec hands off early):
    it must run beside its parent, not after it."""
    parent_id = jobs.get(job_id).parent
    if parent_id is None:
        return False
    parent = jobs.get(parent_id)
    return parse_spec(parent.stage, parent.spec, settings).hands_off_early()


def _submit_next(spec: StageSpec, job_id: str, input_uri: str, jobs: JobStore, dispatch: Dispatch,
                 settings: ServiceSettings) -> str | None:
    """Submit the next stage of `then` on `input_uri`, unless it was already: its id derives from this job's, so a
    redelivered task, or the end of a job that handed off at its start, never enqueues it twice. Its id, or None
    when `then` is empty."""
    if not spec.then:
        return None
    name, overrides = _next_spec(spec.then[0])
    next_job = next_job_id(job_id, name)
    try:
        jobs.get(next_job)
    except JobNotFound:
        nxt_spec = {**overrides, get_stage(name).input_field: input_uri, "then": spec.then[1:]}
        submit(name, nxt_spec, jobs, dispatch, settings, parent=job_id, job_id=next_job)
    return next_job


def execute(job_id: str, jobs: JobStore, store: ObjectStore, settings: Settings, dispatch: Dispatch,
            output: Artifact | None = None, coordination: Coordination | None = None) -> JobRecord:
    settings = ServiceSettings.of(settings)
    job = jobs.get(job_id)
    if job.state in TERMINAL:
        log.info("job %s is already %s; nothing to do", job_id, job.state)
        return job
    if job.cancel_requested:
        return transition(jobs, job_id, "cancelled")
    if job.state == "running" and job.attempts >= settings.max_job_runs:
        # Every run so far ended with its worker gone (a run that ends by itself leaves "running"): the worker is
        # killed by what the job does, most often the kernel's OOM killer at the container's memory limit.
        return transition(jobs, job_id, "failed", error=(
            f"its worker died during each of its {job.attempts} runs (the last on {job.worker}), without an error "
            "of the job's own: a worker killed this way is most often out of memory (the container's OOMKilled "
            "flag, `docker inspect`, says so); give the worker more memory or the job smaller batches "
            f"(EYAS_MAX_JOB_RUNS={settings.max_job_runs} runs are tried)"))
    stage = get_stage(job.stage)
    job = transition(jobs, job_id, "running", attempts=job.attempts + 1, worker=this_worker())
    output = output or job_output(store, job)
    coordination = coordination or coordination_for(settings)
    ctx = StageContext(job_id=job_id, settings=settings, store=store, output=output,
                       attempt=job.attempts, limit=coordination.limit,
                       share=coordination.share(job.stage, job_id, job.attempts))
    wall = _WallTime(settings, ctx.stop)  # past the operator's cap, ctx.stop is set as by a cancel
    ctx.report = _job_reporter(jobs, job_id, wall.passed)
    watch = CancelWatch(jobs, job_id, ctx.stop)  # a cancel request sets ctx.stop at once: ctx.check() raises
    try:
        spec = parse_spec(job.stage, job.spec, settings)
        # A stage whose output is readable while written says so once it is (the extractor, after announcing a
        # features stream): the next stage starts then, beside this job. If this job then fails or is cancelled,
        # the next one is left alone: it learns so from the store and ends.
        ctx.hand_off = partial(_submit_next, spec, job_id, output.uri, jobs, dispatch, settings)
        if output.exists("manifest.json"):
            # A redelivered task whose artifact was already committed: reuse it, write nothing again.
            manifest = read_manifest(output)
            result_uri, metrics = output.uri, dict(manifest.metrics)
            artifacts = {"output": output.uri}
        else:
            result = stage.run(spec, ctx)
            result_uri, metrics, artifacts = result.output_uri, result.metrics, {"output": result.output_uri,
                                                                                  **result.artifacts}
    except Cancelled as e:
        return _stopped(jobs, job_id, settings, wall, ctx.metrics, str(e))
    except Exception as e:  # the job record names why; the traceback goes to this worker's log only
        if ctx.stop.is_set():  # what broke once the stage was told to stop (a wait given up) is the cancel
            log.info("job %s: cancelled (%s: %s)", job_id, type(e).__name__, e)
            return _stopped(jobs, job_id, settings, wall, ctx.metrics, f"job {job_id} was cancelled")
        log.exception("job %s failed", job_id)
        transition(jobs, job_id, "failed", error=f"{type(e).__name__}: {e}"[:2000], metrics=ctx.metrics)
        raise
    finally:
        watch.close()
        wall.close()
    next_job = _submit_next(spec, job_id, result_uri, jobs, dispatch, settings)
    return transition(jobs, job_id, "succeeded", metrics={**ctx.metrics, **metrics}, artifacts=artifacts,
                      next_job=next_job)


def assist(job_id: str, attempt: int, work: Work, jobs: JobStore, store: ObjectStore, settings: Settings,
           coordination: Coordination) -> bool:
    """Work `work` (a share of run `attempt` of a running job) with the job's stage. False, doing nothing, for a job
    that has finished or was run again since. A helper that fails only logs: the job's own run takes over whatever
    it left (orchestration.workshare)."""
    job = jobs.get(job_id)
    stage = get_stage(job.stage)
    if job.state != "running" or job.attempts != attempt or stage.assist is None:
        log.info("job %s: nothing to help with (%s, attempt %d)", job_id, job.state, job.attempts)
        return False
    ctx = StageContext(job_id=job_id, settings=settings, store=store, attempt=attempt,
                       output=job_output(store, job), limit=coordination.limit)
    watch = CancelWatch(jobs, job_id, ctx.stop)  # a helper stops with the job's cancel too
    try:
        stage.assist(parse_spec(job.stage, job.spec, settings), ctx, work)
    except Cancelled:
        log.info("job %s was cancelled; this helper stops", job_id)
    except Exception:
        log.exception("helping job %s failed; its own run takes over", job_id)
    finally:
        watch.close()
    return True

"""Submitting and executing jobs — the one code path behind the API, the Celery tasks, the CLI and `eyas run`.

submit():  validate a spec, create the job record (queued), hand it to the dispatcher.
execute(): run a job's stage, commit its artifact, record the result, and enqueue the next stage of `then`.
assist():  a helper's share of a running job (service mode; the generator shares its prompts among workers).
A redelivered job (its worker died) runs again into the same deterministic prefix; an artifact whose manifest is
already committed there is reused, so it is written exactly once.
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from eyas.jobs import TERMINAL, JobNotFound, JobRecord, JobStore, new_job_id, transition
from eyas.keys import safe_key
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.stages import ARTIFACT_DIRS, STAGE_ORDER, Cancelled, StageContext, get_stage
from eyas.store import Artifact, ObjectStore

log = logging.getLogger(__name__)

Dispatch = Callable[[str, str], None]  # (stage, job_id) → schedules execute(job_id)
Recruit = Callable[[str, str, int, int], None]  # (stage, job_id, attempt, n) → schedules n × assist(job_id, attempt)


class SpecError(ValueError):
    """Bad job spec: `field` and `value` name what is wrong."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field}={value!r}: {message}")
        self.field, self.value, self.message = field, value, message


def _next_spec(step: str | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(step, str):
        return step, {}
    step = dict(step)
    name = step.pop("stage", None)
    if not isinstance(name, str):
        raise SpecError("then[].stage", name, "each `then` entry needs a stage name")
    return name, step


def validate_spec(stage_name: str, spec: dict[str, Any]):
    """Parse a spec for a stage; check every `then` entry too, so a pipeline fails at submit, not hours later."""
    from pydantic import ValidationError

    stage = get_stage(stage_name)
    try:
        parsed = stage.spec_cls.model_validate(spec)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise SpecError(field, err.get("input"), err["msg"]) from None
    prev = stage_name
    for i, step in enumerate(parsed.then):
        name, overrides = _next_spec(step)
        if name not in STAGE_ORDER or STAGE_ORDER.index(name) != STAGE_ORDER.index(prev) + 1:
            raise SpecError(f"then[{i}]", name, f"after {prev!r} the next stage must be "
                            f"{STAGE_ORDER[STAGE_ORDER.index(prev) + 1] if prev != STAGE_ORDER[-1] else 'none'}")
        nxt = get_stage(name)
        try:
            nxt.spec_cls.model_validate({**overrides, nxt.input_field: "pending"})
        except ValidationError as e:
            err = e.errors()[0]
            raise SpecError(f"then[{i}]." + ".".join(str(p) for p in err["loc"]), err.get("input"),
                            err["msg"]) from None
        prev = name
    return parsed


def submit(stage_name: str, spec: dict[str, Any], jobs: JobStore, dispatch: Dispatch,
           parent: str | None = None, job_id: str | None = None) -> JobRecord:
    parsed = validate_spec(stage_name, spec)
    job = JobRecord(id=job_id or new_job_id(stage_name), stage=stage_name, spec=parsed.model_dump(mode="json"),
                    parent=parent)
    jobs.put(job)
    dispatch(stage_name, job.id)
    return job


def job_output(store: ObjectStore, job: JobRecord) -> Artifact:
    """Where a job's artifact lives: {kind}/{job id}, the same for every run of the job and for its helpers."""
    return Artifact(store, safe_key(ARTIFACT_DIRS[job.stage], job.id))


def execute(job_id: str, jobs: JobStore, store: ObjectStore, settings: Settings, dispatch: Dispatch,
            output: Artifact | None = None, recruit: Recruit | None = None) -> JobRecord:
    job = jobs.get(job_id)
    if job.state in TERMINAL:
        log.info("job %s is already %s; nothing to do", job_id, job.state)
        return job
    if job.cancel_requested:
        return transition(jobs, job_id, "cancelled")
    stage = get_stage(job.stage)
    job = transition(jobs, job_id, "running", attempts=job.attempts + 1)
    output = output or job_output(store, job)
    ctx = StageContext(job_id=job_id, settings=settings, store=store, jobs=jobs, output=output,
                       attempt=job.attempts, recruit=None if recruit is None else (
                           lambda n: recruit(job.stage, job_id, job.attempts, n)))
    try:
        spec = stage.spec_cls.model_validate(job.spec)
        if output.exists("manifest.json"):
            # A redelivered task whose artifact was already committed: reuse it, write nothing again.
            manifest = read_manifest(output)
            result_uri, metrics = output.uri, dict(manifest.extra.get("metrics", {}))
            artifacts = {"output": output.uri}
        else:
            result = stage.run(spec, ctx)
            result_uri, metrics, artifacts = result.output_uri, result.metrics, {"output": result.output_uri,
                                                                                  **result.artifacts}
    except Cancelled as e:
        return transition(jobs, job_id, "cancelled", error=str(e))
    except Exception as e:  # the job record says why; the worker stays up
        log.exception("job %s failed", job_id)
        detail = f"{type(e).__name__}: {e}"
        transition(jobs, job_id, "failed", error=detail, metrics={**ctx.metrics, "traceback":
                                                                   traceback.format_exc(limit=5)})
        raise
    next_job = None
    if spec.then:
        # The next job's id derives from this one, so a redelivered task never enqueues it twice.
        name, overrides = _next_spec(spec.then[0])
        next_job = f"{name[:3]}-{job_id.split('-', 1)[1]}"
        try:
            jobs.get(next_job)
        except JobNotFound:
            nxt_stage = get_stage(name)
            nxt_spec = {**overrides, nxt_stage.input_field: result_uri, "then": spec.then[1:]}
            submit(name, nxt_spec, jobs, dispatch, parent=job_id, job_id=next_job)
    return transition(jobs, job_id, "succeeded", metrics={**ctx.metrics, **metrics}, artifacts=artifacts,
                      next_job=next_job)


def assist(job_id: str, attempt: int, jobs: JobStore, store: ObjectStore, settings: Settings) -> None:
    """Help run `attempt` of a running job. A helper that finds the job finished, or re-run since, does nothing;
    one that fails only logs: the job's own run takes over whatever it left (see services/generator/workshare)."""
    job = jobs.get(job_id)
    stage = get_stage(job.stage)
    if job.state != "running" or job.attempts != attempt or stage.assist is None:
        log.info("job %s: nothing to help with (%s, attempt %d)", job_id, job.state, job.attempts)
        return
    ctx = StageContext(job_id=job_id, settings=settings, store=store, jobs=jobs, attempt=attempt,
                       output=job_output(store, job))
    try:
        stage.assist(stage.spec_cls.model_validate(job.spec), ctx)
    except Exception:
        log.exception("helping job %s failed; its own run takes over", job_id)

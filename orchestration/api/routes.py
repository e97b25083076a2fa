"""The routes of a stage's job API: jobs (submit, read, list, cancel) and the probes (health, readiness, metrics).

Routes are thin: each calls one function of orchestration.execution or orchestration.jobs and shapes its answer.
"""
# No `from __future__ import annotations` here: FastAPI reads the body type (the stage's spec class, a local of
# job_routes) from the annotation when the route is declared.

import concurrent.futures
import contextlib
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from eyas.stage import StageSpec
from orchestration.api.deps import v1_dependencies
from orchestration.api.schemas import JobView, Message, Problems, Submitted, links, problem, view
from orchestration.execution import SpecError, submit
from orchestration.jobs import (
    AlreadyEnded,
    JobNotFound,
    JobRecord,
    State,
    new_job_id,
    request_cancel,
    transition,
)
from orchestration.lease import job_lease
from orchestration.runtime import Runtime
from orchestration.settings import ServiceSettings

log = logging.getLogger(__name__)
JobId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="job id")]


def job_routes(stage: str, spec_cls: type[StageSpec], runtime: Runtime, settings: ServiceSettings,
               rejected: Counter) -> APIRouter:
    router = APIRouter(prefix="/v1/jobs", dependencies=v1_dependencies(settings))
    errors = error_responses(settings)
    missing = {404: {"model": Problems, "description": f"no such {stage} job (another stage's job is its service's)"}}
    # whether a running job's worker still holds its lease (service mode: orchestration.lease)
    alive = None if runtime.leases is None else (lambda job_id: runtime.leases.held(job_lease(job_id)))

    def get_job(job_id: str) -> JobRecord:
        """This stage's job `job_id`; another stage's job is answered as absent (404): each service reads, lists
        and cancels its own stage's jobs only, whatever the job store they share holds."""
        try:
            job = runtime.jobs.get(job_id)
        except JobNotFound:
            job = None
        if job is None or job.stage != stage:
            raise HTTPException(404, [problem("id", job_id, f"no such {stage} job")])
        return job

    @router.post("", status_code=202, response_model=Submitted,
                 responses={**errors, 413: {"model": Problems, "description": "the body is over max_request_bytes"},
                            503: {"model": Message,
                                  "description": "the queue could not take the job (the job record says so)"}})
    def submit_job(spec: Annotated[spec_cls, Body()], response: Response) -> Submitted:
        return _submit(stage, spec, runtime, rejected, response)

    @router.get("/{job_id}", response_model=JobView, responses={**errors, **missing})
    def read_job(job_id: JobId) -> JobView:
        return view(get_job(job_id), alive)

    @router.get("", response_model=list[JobView], responses=errors)
    def list_jobs(request: Request,
                  state: Annotated[list[State] | None, Query(description="only jobs in these states (repeat it: "
                                                                         "?state=queued&state=running)")] = None,
                  limit: Annotated[int, Query(ge=1, le=1000, description="at most this many, newest first")] = 100,
                  ) -> list[JobView]:
        if len(given := request.query_params.getlist("limit")) > 1:  # one value a field, not the last one silently
            raise HTTPException(422, [problem("limit", given, "give limit once")])
        jobs = [j for s in dict.fromkeys(state or [None]) for j in runtime.jobs.list(stage=stage, limit=limit, state=s)]
        return [view(j, alive) for j in sorted(jobs, key=lambda j: j.created_at, reverse=True)[:limit]]

    @router.post("/{job_id}/cancel", status_code=202, response_model=JobView,
                 responses={**errors, **missing, 409: {"model": Problems, "description": "the job has already ended"}})
    def cancel_job(job_id: JobId) -> JobView:
        job = get_job(job_id)
        try:
            return view(request_cancel(runtime.jobs, job_id), alive)
        except AlreadyEnded:
            raise HTTPException(409, [problem("state", get_job(job_id).state,
                                              f"job {job.id} has already ended")]) from None

    return router


def probe_routes(stage: str, runtime: Runtime, settings: ServiceSettings, registry: CollectorRegistry) -> APIRouter:
    router = APIRouter()

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "stage": stage, "mode": settings.mode}

    @router.get("/readyz", responses={503: {"description": "a dependency is unreachable"}})
    def readyz() -> JSONResponse:
        """Which dependency is down, not where it is or what it said (this probe needs no key): the API's log
        has that."""
        results: dict[str, str] = {}
        pool = concurrent.futures.ThreadPoolExecutor(len(runtime.checks))
        futures = {name: pool.submit(check) for name, check in runtime.checks.items()}
        deadline = time.monotonic() + 5
        for name, fut in futures.items():
            try:
                fut.result(timeout=max(deadline - time.monotonic(), 0))
                results[name] = "ok"
            except concurrent.futures.TimeoutError:
                results[name] = "no answer within 5 s"
            except Exception as e:
                log.warning("readiness: %s is down: %s: %s", name, type(e).__name__, e)
                results[name] = "down"
        pool.shutdown(wait=False)  # a hung check must not hang the probe
        ready = all(v == "ok" for v in results.values())
        return JSONResponse(status_code=200 if ready else 503,
                            content={"status": "ready" if ready else "not ready", "checks": results})

    @router.get("/metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def error_responses(settings: ServiceSettings) -> dict[int, dict]:
    """The errors every route of a stage's jobs may answer: an invalid request, and a missing or wrong API key
    where the service has one."""
    errors = {422: {"model": Problems, "description": "invalid request: detail names the field and the value"}}
    if settings.api_key is not None:
        errors |= {401: {"model": Message, "description": "no API key"},
                   403: {"model": Message, "description": "wrong API key"}}
    return errors


def _submit(stage: str, spec: StageSpec, runtime: Runtime, rejected: Counter, response: Response) -> Submitted:
    """Submit a job of `stage`: a spec the stage refuses is a 422 that names the field, a queue that does not take it
    a 503 (and the job record says so)."""
    job_id = new_job_id(stage)
    try:
        # python mode: a number the JSON dump would turn into null (Infinity in a free-form field) stays
        # what was sent, and submit refuses it
        job = submit(stage, spec.model_dump(exclude_unset=True), runtime.jobs, runtime.dispatch,
                     runtime.settings, job_id=job_id)
    except SpecError as e:
        rejected.labels(stage).inc()
        raise HTTPException(422, [problem(e.field, e.value, e.message)]) from None
    except Exception as e:  # the record exists but no queue took it: say so on the job and to the caller
        log.exception("could not enqueue job %s", job_id)
        with contextlib.suppress(Exception):
            transition(runtime.jobs, job_id, "failed", error=f"could not enqueue: {type(e).__name__}: {e}")
        raise HTTPException(503, f"could not enqueue job {job_id}: {type(e).__name__}: {e}") from None
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return Submitted(id=job.id, status=job.state, links=links(job))

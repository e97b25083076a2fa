"""The job API, one shape for every stage's service: `create_app(stage)`.

  POST /v1/jobs               body: the stage's job spec (with optional `then`) → 202 {id, status, links}
  GET  /v1/jobs/{id}          the job record: state, progress, metrics, artifact URIs, error
  GET  /v1/jobs?state=&limit= this stage's jobs, newest first
  POST /v1/jobs/{id}/cancel   queued → cancelled at once; running → stops at its next progress report
  GET  /healthz  /readyz (broker, job store and object store reachable, else 503)  /metrics (Prometheus)
  /docs, /openapi.json

Serve one with `eyas api --stage generate --port 8000` (→ `serve_api`) or `uvicorn services.generator.api:app`.
In service mode (EYAS_MODE=service) jobs go to the stage's Celery queue; in embedded mode a background thread of
this process runs them. With EYAS_API_KEY set, /v1/* needs `Authorization: Bearer <key>` (401 without, 403 wrong).
Bad input gets a 422 whose detail names the field and the value, and nothing is written for it.
"""
import concurrent.futures
import contextlib
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.jobs import (TERMINAL, IllegalTransition, JobNotFound, JobRecord, State, new_job_id, transition,
                       update)
from eyas.pipeline import SpecError, submit
from eyas.runtime import Runtime, runtime_for
from eyas.settings import Settings, get_settings
from eyas.stages import get_stage

log = logging.getLogger(__name__)
JobId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="job id")]


class Submitted(BaseModel):
    id: str
    status: State
    links: dict[str, str]


class JobView(JobRecord):
    links: dict[str, str]


class Problem(BaseModel):
    field: str  # the field at fault, dotted ("sampling.max_tokens", "then[0].stage", "body")
    value: Any = None  # the value given
    message: str


class Problems(BaseModel):
    """4xx answers that name what is wrong."""
    detail: list[Problem]


class Message(BaseModel):
    detail: str


def _links(job: JobRecord) -> dict[str, str]:
    links = {"self": f"/v1/jobs/{job.id}", "cancel": f"/v1/jobs/{job.id}/cancel"}
    if job.next_job:
        links["next"] = f"/v1/jobs/{job.next_job}"
    if job.parent:
        links["parent"] = f"/v1/jobs/{job.parent}"
    return links


def _view(job: JobRecord) -> JobView:
    return JobView(**job.model_dump(), links=_links(job))


def _problem(field: str, value: Any, message: str) -> dict[str, Any]:
    try:
        value = jsonable_encoder(value)
    except (TypeError, ValueError):
        value = repr(value)
    return {"field": field, "value": value, "message": message}


class _JobCollector:
    """Job counts by stage and state, read from the job store at scrape time: the same numbers whichever API
    replica is scraped, and including the jobs that workers ran and `then` pipelines submitted."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def collect(self):
        counts = self.runtime.jobs.counts()
        submitted = CounterMetricFamily("eyas_jobs_submitted", "jobs accepted, by stage", labels=["stage"])
        ended = {s: CounterMetricFamily(f"eyas_jobs_{s}", f"jobs that ended {s}, by stage", labels=["stage"])
                 for s in sorted(TERMINAL)}
        active = GaugeMetricFamily("eyas_jobs_active", "jobs queued or running", labels=["stage", "state"])
        for stage in sorted({st for st, _ in counts}):
            submitted.add_metric([stage], sum(n for (st, _), n in counts.items() if st == stage))
            for state, family in ended.items():
                family.add_metric([stage], counts.get((stage, state), 0))
            for state in ("queued", "running"):
                active.add_metric([stage, state], counts.get((stage, state), 0))
        # live numbers of running jobs (generator: concurrency, in_flight, completed, failed, retried, tokens_per_s)
        live = GaugeMetricFamily("eyas_job_metric", "numeric metrics of running jobs", labels=["stage", "job", "name"])
        for job in self.runtime.jobs.list(state="running", limit=100):
            for name, value in job.metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    live.add_metric([job.stage, job.id, name], float(value))
        yield submitted
        yield from ended.values()
        yield active
        yield live


def create_app(stage: str, settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    spec_cls = get_stage(stage).spec_cls
    runtime = runtime_for(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        runtime.close()

    app = FastAPI(title=f"Eyas {stage} service", version="1", lifespan=lifespan,
                  description=f"Job API of the {stage} stage ({settings.mode} mode).")

    registry = CollectorRegistry()
    registry.register(_JobCollector(runtime))
    latency = Histogram("eyas_http_request_duration_seconds", "API request latency", ["method", "route", "status"],
                        registry=registry)
    rejected = Counter("eyas_jobs_rejected", "job submissions refused as invalid", ["stage"], registry=registry)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        """Job specs are small; a body over max_request_bytes is refused before it is read (413)."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_request_bytes):
            return JSONResponse(status_code=413, content={"detail": [_problem(
                "body", f"<{length} bytes>", f"request bodies are limited to {settings.max_request_bytes} bytes")]})
        return await call_next(request)

    @app.middleware("http")
    async def time_requests(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        latency.labels(request.method, getattr(route, "path", "unmatched"), str(response.status_code)).observe(
            time.perf_counter() - t0)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ())]
            if err.get("type") == "json_invalid":  # loc: ("body", character offset)
                error = (err.get("ctx") or {}).get("error", "")
                problems.append(_problem("body", f"<not JSON at character {loc[-1]}>", f"invalid JSON: {error}"))
                continue
            if loc and loc[0] in ("body", "query", "path"):
                loc = loc[1:]
            problems.append(_problem(".".join(loc) or "body", err.get("input"), err.get("msg", "invalid")))
        if request.url.path == "/v1/jobs" and request.method == "POST":
            rejected.labels(stage).inc()
        return JSONResponse(status_code=422, content={"detail": problems})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body it cannot decode (not UTF-8): a 422 naming the body, like any bad JSON
            return JSONResponse(status_code=422, content={"detail": [_problem(
                "body", "<undecodable bytes>", "the body is not UTF-8 JSON text")]})
        return await http_exception_handler(request, exc)

    bearer = HTTPBearer(auto_error=False, description="EYAS_API_KEY, when the service has one")

    def authorized(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if settings.api_key is None:
            return
        if cred is None or not cred.credentials:
            raise HTTPException(401, "missing API key: send Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(cred.credentials.encode(), settings.api_key.get_secret_value().encode()):
            raise HTTPException(403, "wrong API key")

    def known_query(request: Request) -> None:
        """A misspelt query parameter (`?stat=failed`) is an error, not a silently unfiltered answer."""
        route = request.scope.get("route")
        allowed = {p.alias for p in route.dependant.query_params} if route is not None else set()
        unknown = [k for k in request.query_params if k not in allowed]
        if unknown:
            raise HTTPException(422, [_problem(k, request.query_params[k], "unknown query parameter"
                                               + (f"; this route takes {sorted(allowed)}" if allowed else ""))
                                      for k in unknown])

    # The key is documented (OpenAPI security) and checked only when the service has one.
    v1 = ([Depends(authorized)] if settings.api_key is not None else []) + [Depends(known_query)]
    errors = {422: {"model": Problems, "description": "invalid request: detail names the field and the value"}}
    if settings.api_key is not None:
        errors |= {401: {"model": Message, "description": "no API key"},
                   403: {"model": Message, "description": "wrong API key"}}
    missing = {404: {"model": Problems, "description": "no such job"}}

    def get_job(job_id: str) -> JobRecord:
        try:
            return runtime.jobs.get(job_id)
        except JobNotFound:
            raise HTTPException(404, [_problem("id", job_id, "no such job")]) from None

    @app.post("/v1/jobs", status_code=202, response_model=Submitted, dependencies=v1,
              responses={**errors, 503: {"model": Message,
                                       "description": "the queue could not take the job (the job record says so)"}})
    def submit_job(spec: Annotated[spec_cls, Body()], response: Response) -> Submitted:
        job_id = new_job_id(stage)
        try:
            job = submit(stage, spec.model_dump(mode="json", exclude_unset=True), runtime.jobs, runtime.dispatch,
                         job_id=job_id)
        except SpecError as e:
            rejected.labels(stage).inc()
            raise HTTPException(422, [_problem(e.field, e.value, e.message)]) from None
        except Exception as e:  # the record exists but no queue took it: say so on the job and to the caller
            log.exception("could not enqueue job %s", job_id)
            with contextlib.suppress(Exception):
                transition(runtime.jobs, job_id, "failed", error=f"could not enqueue: {type(e).__name__}: {e}")
            raise HTTPException(503, f"could not enqueue job {job_id}: {type(e).__name__}: {e}") from None
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return Submitted(id=job.id, status=job.state, links=_links(job))

    @app.get("/v1/jobs/{job_id}", response_model=JobView, dependencies=v1, responses={**errors, **missing})
    def read_job(job_id: JobId) -> JobView:
        return _view(get_job(job_id))

    @app.get("/v1/jobs", response_model=list[JobView], dependencies=v1, responses=errors)
    def list_jobs(state: Annotated[State | None, Query()] = None,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobView]:
        return [_view(j) for j in runtime.jobs.list(stage=stage, limit=limit, state=state)]

    @app.post("/v1/jobs/{job_id}/cancel", status_code=202, response_model=JobView, dependencies=v1,
              responses={**errors, **missing, 409: {"model": Problems, "description": "the job has already ended"}})
    def cancel_job(job_id: JobId) -> JobView:
        job = get_job(job_id)
        if job.state == "queued":
            try:
                return _view(transition(runtime.jobs, job_id, "cancelled", cancel_requested=True,
                                        error="cancelled before it started"))
            except IllegalTransition:  # a worker started it meanwhile
                job = get_job(job_id)
        if job.state in TERMINAL:
            raise HTTPException(409, [_problem("state", job.state, f"job {job_id} has already ended")])
        # running: the stage stops at its next progress report (eyas.stages.StageContext.progress)
        return _view(update(runtime.jobs, job_id, cancel_requested=True))

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "stage": stage, "mode": settings.mode}

    @app.get("/readyz", responses={503: {"description": "a dependency is unreachable"}})
    def readyz() -> JSONResponse:
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
                results[name] = f"{type(e).__name__}: {e}"
        pool.shutdown(wait=False)  # a hung check must not hang the probe
        ready = all(v == "ok" for v in results.values())
        return JSONResponse(status_code=200 if ready else 503,
                            content={"status": "ready" if ready else "not ready", "checks": results})

    @app.get("/metrics", response_class=Response)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_api(stage: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `create_app(stage)` with uvicorn until stopped (what `eyas api --stage S` runs)."""
    import uvicorn

    uvicorn.run(create_app(stage), host=host, port=port, log_level="info")


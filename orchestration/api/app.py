"""The job API, one shape for every stage's service: `create_app(stage)`.

  POST /v1/jobs               body: the stage's job spec (with optional `then`) → 202 {id, status, links}
  GET  /v1/jobs/{id}          the job record: state, progress, metrics, artifact URIs, error
  GET  /v1/jobs?state=&limit= this stage's jobs, newest first
  POST /v1/jobs/{id}/cancel   queued → cancelled at once; running → cancelled within seconds (its stage stops
                              between steps: orchestration.cancel_watch)
  GET  /healthz  /readyz (broker, job store and object store reachable, else 503: which is down, not where)
  GET  /metrics (Prometheus)   /docs, /openapi.json (each field naming a file or URL carries its allowed pattern)
  GET  /v1/watch/{name}, /v1/watch/{name}/series, /v1/watch/{name}/plot.png, /v1/promotions/{name}
                              the loop, read-only (orchestration.api.loop), on the evaluate stage's service only

Serve one with `eyas api --stage generate --port 8000` (→ `serve_api`).
In service mode (EYAS_MODE=service) jobs go to the stage's Celery queue; in embedded mode a background thread of
this process runs them. With EYAS_API_KEY set, /v1/* needs `Authorization: Bearer <key>` (401 without, 403 wrong),
and /openapi.json, /docs and /redoc need the key too (Bearer, or HTTP Basic's password: guards.DocsKey). A service
answers for its own stage's jobs only: another stage's job id is a 404 on read and cancel, as an absent one is.
The access log names each request's path without its query string (a key sent as a query parameter stays out).
Bad input gets a 4xx whose detail names the field and the value, and nothing is written for it: 422 for a spec
(a file, object or URL the settings do not allow too: eyas.confine), 413 for a body over max_request_bytes (counted
as it streams), 405 for a method the path does not have (OPTIONS lists them).
"""
import copy
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException

from eyas.settings import Settings
from orchestration.api.guards import BodyLimit, DocsKey, Methods
from orchestration.api.loop import loop_routes
from orchestration.api.metrics import JobCollector
from orchestration.api.openapi import documented
from orchestration.api.routes import job_routes, probe_routes
from orchestration.api.schemas import problem
from orchestration.registry import get_stage
from orchestration.runtime import runtime_for
from orchestration.settings import ServiceSettings, get_service_settings

log = logging.getLogger(__name__)
MAX_PROBLEMS = 20  # named in one 422
LOOP_STAGE = "evaluate"  # the service that shows the loop: the served τ is what its stage measures


def _unparsable(cause: BaseException | None) -> dict:
    if isinstance(cause, RecursionError):
        return problem("body", "<nested too deeply>", "the JSON nests deeper than a job spec may (arrays and "
                       "objects inside each other, hundreds of levels)")
    if isinstance(cause, UnicodeDecodeError):
        return problem("body", "<undecodable bytes>", "the body is not UTF-8 JSON text")
    return problem("body", "<unparsable>", f"the body could not be parsed ({type(cause).__name__})")


def _problems(errors: list[dict]) -> list[dict]:
    """A request's validation errors as problems that name the field (the body's, the path's or the query's) and the
    value; at most MAX_PROBLEMS of them (a MiB of unknown keys would make a MB-sized answer)."""
    problems = []
    for err in errors[:MAX_PROBLEMS]:
        loc = [str(p) for p in err.get("loc", ())]
        if err.get("type") == "json_invalid":  # loc: ("body", character offset)
            error = (err.get("ctx") or {}).get("error", "")
            problems.append(problem("body", f"<not JSON at character {loc[-1]}>", f"invalid JSON: {error}"))
            continue
        if loc and loc[0] == "query":  # the parameter, whichever of its repeated values is wrong
            loc = loc[1:2]
        elif loc and loc[0] in ("body", "path"):
            loc = loc[1:]
        problems.append(problem(".".join(loc) or "body", err.get("input"), err.get("msg", "invalid")))
    if len(errors) > MAX_PROBLEMS:
        problems.append(problem("body", None, f"and {len(errors) - MAX_PROBLEMS} more problems"))
    return problems


def create_app(stage: str, settings: Settings | None = None) -> FastAPI:
    settings = ServiceSettings.of(settings) if settings else get_service_settings()
    spec_cls = get_stage(stage).spec_cls
    runtime = runtime_for(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        runtime.close()

    app = FastAPI(title=f"Eyas {stage} service", version="1", lifespan=lifespan,
                  description=f"Job API of the {stage} stage ({settings.mode} mode).")

    # The innermost middleware (added first): the route reads the body through its counting `receive` itself, so
    # a limit it raises mid-body reaches FastAPI as the HTTPException it is.
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)

    registry = CollectorRegistry()
    registry.register(JobCollector(runtime.jobs))
    latency = Histogram("eyas_http_request_duration_seconds", "API request latency", ["method", "route", "status"],
                        registry=registry)
    rejected = Counter("eyas_jobs_rejected", "job submissions refused as invalid", ["stage"], registry=registry)

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
        problems = _problems(exc.errors())
        if request.url.path == "/v1/jobs" and request.method == "POST":
            rejected.labels(stage).inc()
        return JSONResponse(status_code=422, content={"detail": problems})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to a body its parser raised on (the parser's exception is the cause): a 422 naming
            # the body and what is wrong with it, like any bad JSON
            return JSONResponse(status_code=422, content={"detail": [_unparsable(exc.__cause__)]})
        return await http_exception_handler(request, exc)

    app.include_router(job_routes(stage, spec_cls, runtime, settings, rejected))
    app.include_router(probe_routes(stage, runtime, settings, registry))
    if stage == LOOP_STAGE:
        app.include_router(loop_routes(runtime.store, settings))
    if settings.api_key is not None:
        app.add_middleware(DocsKey, paths={app.openapi_url, app.docs_url, app.redoc_url},
                           key=settings.api_key.get_secret_value())
    app.add_middleware(Methods, paths=lambda: app.openapi()["paths"])  # added last: the outermost
    app.openapi = documented(app, stage, settings)
    return app


class PathOnly(logging.Filter):
    """uvicorn's access log line with the request's path only: a query string may carry a secret (a client that sent
    its key as `?api_key=`), and the log is read by more people than the key is."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: args = (client address, method, path with query string, HTTP version, status)
        if isinstance(record.args, tuple) and len(record.args) == 5 and isinstance(record.args[2], str):
            client, method, path, version, status = record.args
            record.args = (client, method, path.split("?", 1)[0], version, status)
        return True


def serve_api(stage: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve `create_app(stage)` with uvicorn until stopped (what `eyas api --stage S` runs): uvicorn's own logging,
    its access log through PathOnly."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config.setdefault("filters", {})["path_only"] = {"()": PathOnly}
    log_config["loggers"]["uvicorn.access"]["filters"] = ["path_only"]
    uvicorn.run(create_app(stage), host=host, port=port, log_level="info", log_config=log_config)


"""Wiring of a running process: the job store, the object store and the dispatcher, chosen by settings.mode.

  service   RedisJobStore + S3Store + Celery (each job goes to its stage's queue; workers run it)
  embedded  SQLite + local directory (orchestration.embedded) + a background thread of this process that runs the jobs

Both hand jobs to `orchestration.execution.execute`, the one code path for every job.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from eyas.settings import Settings
from eyas.store import ObjectStore, S3Store
from orchestration.coordination import Coordination, coordination_for
from orchestration.execution import Dispatch, execute, runs_beside_parent
from orchestration.jobs import JobStore, RedisJobStore
from orchestration.lease import Leases
from orchestration.settings import ServiceSettings

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: ServiceSettings
    jobs: JobStore
    store: ObjectStore
    dispatch: Dispatch
    coordination: Coordination  # what its stages coordinate through (orchestration.coordination)
    leases: Leases | None = None  # service mode: the leases of the jobs and chunks this process works on
    checks: dict[str, Callable[[], None]] = field(default_factory=dict)  # readiness: name → raises if not ready
    close: Callable[[], None] = lambda: None


def service_runtime(settings: Settings) -> Runtime:
    from orchestration.celery_app import celery_dispatch, celery_send_chunk, make_celery

    settings = ServiceSettings.of(settings)
    app = make_celery(settings)
    jobs = RedisJobStore(settings.redis_url)
    store = S3Store(settings)
    leases = Leases(redis.Redis.from_url(settings.redis_url), settings.visibility_timeout_s)

    def broker() -> None:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=3)

    return Runtime(settings=settings, jobs=jobs, store=store, dispatch=celery_dispatch(app),
                   coordination=coordination_for(settings, leases, celery_send_chunk(app)), leases=leases,
                   checks={"broker": broker, "jobs": jobs.ping, "store": store.ping})


class BackgroundExecutor:
    """Embedded mode behind an API: jobs (and the stages of their `then`) run one at a time in a daemon thread, but
    for a job handed its input while its parent still writes it, which runs beside the parent in a thread of its
    own (orchestration.execution.runs_beside_parent). On start it picks up the jobs a previous process left queued or
    running, as a worker would after a crash."""

    def __init__(self, jobs: JobStore, store: ObjectStore, settings: ServiceSettings):
        self.jobs, self.store, self.settings = jobs, store, settings
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="eyas-embedded-jobs", daemon=True)
        left = [j for state in ("running", "queued") for j in jobs.list(limit=100_000, state=state)]
        for job in sorted(left, key=lambda j: j.created_at):
            self._queue.put(job.id)
        self._thread.start()

    def dispatch(self, _stage: str, job_id: str) -> None:
        if runs_beside_parent(self.jobs, job_id, self.settings):
            threading.Thread(target=self._execute, args=(job_id,), name=f"eyas-{job_id}", daemon=True).start()
        else:
            self._queue.put(job_id)

    def _execute(self, job_id: str) -> None:
        try:
            execute(job_id, self.jobs, self.store, self.settings, self.dispatch)
        except Exception:  # recorded on the job by execute; the thread lives on
            log.exception("job %s failed", job_id)

    def _loop(self) -> None:
        while (job_id := self._queue.get()) is not None:
            self._execute(job_id)

    def alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the embedded job thread has stopped")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def embedded_runtime(settings: Settings) -> Runtime:
    from orchestration.embedded import EmbeddedRunner

    settings = ServiceSettings.of(settings)
    emb = EmbeddedRunner(settings)
    executor = BackgroundExecutor(emb.jobs, emb.store, settings)
    return Runtime(settings=settings, jobs=emb.jobs, store=emb.store, dispatch=executor.dispatch,
                   coordination=coordination_for(settings),
                   checks={"executor": executor.alive, "jobs": emb.jobs.ping, "store": emb.store.ping},
                   close=executor.close)


def runtime_for(settings: Settings) -> Runtime:
    settings = ServiceSettings.of(settings)
    return service_runtime(settings) if settings.mode == "service" else embedded_runtime(settings)

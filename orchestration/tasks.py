"""The Celery tasks of the service mode (run a job; help run a job), and the worker entry point.

Start a stage's worker with `eyas worker --stage generate [--concurrency N]` (→ `run_worker`), or
`python -m services.generator.worker`. The worker reads settings from the environment (EYAS_MODE=service,
EYAS_REDIS_URL, EYAS_S3_*), consumes only its stage's queue and runs each job through `orchestration.execution.execute`
with the S3 object store and the Redis job store; a job's `then` stages go to the next stage's queue.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from functools import lru_cache

from kombu.transport.redis import Channel

from orchestration.celery_app import ASSIST_TASK, TASK, make_celery
from orchestration.jobs import IllegalTransition, JobNotFound
from orchestration.execution import assist, execute
from orchestration.runtime import Runtime, service_runtime
from eyas.settings import get_settings
from orchestration.registry import STAGE_ORDER, get_stage

log = logging.getLogger(__name__)
app = make_celery(get_settings())


@lru_cache
def _runtime() -> Runtime:
    # built lazily, in the pool process that runs tasks (no connections shared across fork)
    runtime = service_runtime(get_settings())
    runtime.store.ensure_bucket()
    return runtime


@contextlib.contextmanager
def _keep_delivery_young(runtime: Runtime, delivery_tag: str | None):
    """Renew this task's delivery in kombu's unacked index while it runs, so the restore sweep hands it to another
    worker only after this worker stops renewing it (dead), never while it is still working on it."""
    if not delivery_tag:
        yield
        return
    import redis

    client = redis.Redis.from_url(runtime.settings.redis_url)
    every = max(runtime.settings.visibility_timeout_s / 6, 0.2)
    stop = threading.Event()

    def renew() -> None:
        while True:
            try:  # XX: only while the delivery is still unacked (never resurrect an acked one)
                client.zadd(Channel.unacked_index_key, {delivery_tag: time.time()}, xx=True)
            except redis.RedisError as e:
                log.warning("could not renew delivery %s: %s", delivery_tag, e)
            if stop.wait(every):
                return

    thread = threading.Thread(target=renew, name="eyas-renew-delivery", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        client.close()


@app.task(name=TASK, bind=True)
def run_job(self, job_id: str) -> str:
    runtime = _runtime()
    with _keep_delivery_young(runtime, (self.request.properties or {}).get("delivery_tag")):
        try:
            job = execute(job_id, runtime.jobs, runtime.store, runtime.settings, runtime.dispatch,
                          recruit=runtime.recruit)
        except (JobNotFound, IllegalTransition) as e:  # deleted, or cancelled between our read and our start
            log.warning("job %s not run: %s", job_id, e)
            return "skipped"
    return job.state


@app.task(name=ASSIST_TASK, bind=True)
def assist_job(self, job_id: str, attempt: int) -> str:
    runtime = _runtime()
    with _keep_delivery_young(runtime, (self.request.properties or {}).get("delivery_tag")):
        try:
            assist(job_id, attempt, runtime.jobs, runtime.store, runtime.settings)
        except JobNotFound as e:
            log.warning("job %s not helped: %s", job_id, e)
    return "done"


def run_worker(stage: str, concurrency: int = 1) -> None:
    """Consume `stage`'s queue with `concurrency` pool processes until stopped (SIGTERM: finish, then exit)."""
    if stage not in STAGE_ORDER:
        raise ValueError(f"stage={stage!r}: stages are {list(STAGE_ORDER)}")
    get_stage(stage)  # import the stage (torch, transformers) once, before the pool processes fork
    app.worker_main(argv=[
        "worker", f"--queues={stage}", f"--concurrency={concurrency}", "--pool=prefork",
        f"--hostname={stage}-{os.getpid()}@%h", "--loglevel=INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ])

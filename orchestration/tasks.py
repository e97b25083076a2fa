"""The Celery tasks of the service mode (run a job; work a chunk of a running job), the worker's sweep for jobs whose
worker died, and the worker entry point.

Start a stage's worker with `eyas worker --stage generate [--concurrency N]` (→ `run_worker`). The worker reads
settings from the environment (EYAS_MODE=service, EYAS_REDIS_URL, EYAS_S3_*), consumes only its stage's queue and
runs each job through `orchestration.execution.execute` with the S3 object store and the Redis job store; a job's
`then` stages go to the next stage's queue.

A task holds its job's lease while it runs (orchestration.lease); a delivery of a job whose lease is held elsewhere
is a duplicate (a requeue raced with the broker's backstop, see orchestration.celery_app) and does nothing. Every
`lease_sweep_s`, each worker sends the running jobs of its stage whose lease nobody holds to the queue
again: their worker died, and the job runs again (its next attempt), resuming from what it committed.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from celery.signals import worker_ready

from orchestration.celery_app import ASSIST_TASK, TASK, make_celery
from orchestration.execution import assist, execute
from orchestration.jobs import IllegalTransition, JobNotFound
from orchestration.lease import job_lease
from orchestration.registry import STAGES, get_stage
from orchestration.runtime import Runtime, service_runtime
from orchestration.settings import get_service_settings
from orchestration.workshare import ORDERED, ChunkWork, ordered_chunks

log = logging.getLogger(__name__)
app = make_celery(get_service_settings())


@lru_cache
def _runtime() -> Runtime:
    # built lazily, in the pool process that runs tasks (no connections shared across fork)
    runtime = service_runtime(get_service_settings())
    runtime.store.ensure_bucket()
    return runtime


@app.task(name=TASK)
def run_job(job_id: str) -> str:
    runtime = _runtime()
    lease = runtime.leases.try_hold(job_lease(job_id))
    if lease is None:
        log.info("job %s is running on a live worker (its lease is held): this delivery is a duplicate", job_id)
        return "duplicate"
    try:
        job = execute(job_id, runtime.jobs, runtime.store, runtime.settings, runtime.dispatch,
                      coordination=runtime.coordination)
    except (JobNotFound, IllegalTransition) as e:  # deleted, or cancelled between our read and our start
        log.warning("job %s not run: %s", job_id, e)
        return "skipped"
    finally:
        lease.release()
    return job.state


@app.task(name=ASSIST_TASK)
def assist_job(job_id: str, attempt: int, index: int, ids: list[str]) -> str:
    runtime = _runtime()
    ordered = index == ORDERED
    work = ChunkWork(runtime.leases.client, runtime.leases, job_id, attempt,
                     ordered_chunks(ids) if ordered else {index: ids}, owner=False, ordered=ordered)
    try:
        helped = assist(job_id, attempt, work, runtime.jobs, runtime.store, runtime.settings, runtime.coordination)
    except JobNotFound as e:
        log.warning("job %s not helped: %s", job_id, e)
        helped = False
    finally:
        work.close()
    return "helped" if helped else "nothing to do"


def requeue_orphans(runtime: Runtime, stage: str) -> list[str]:
    """Send each running job of `stage` whose lease nobody holds (its worker died) to the queue again, once per
    attempt: the run it starts is the next attempt, which is requeued in turn if its worker dies too."""
    requeued = []
    for job in runtime.jobs.list(stage=stage, state="running", limit=100_000):
        lease = runtime.leases.try_hold(job_lease(job.id))
        if lease is None:
            continue  # its worker is alive
        try:
            # once per attempt for a while: again if the delivery was lost before its task took the lease
            once = runtime.leases.client.set(f"{job_lease(job.id)}:requeued:{job.attempts}", 1, nx=True,
                                             ex=max(60, int(10 * runtime.settings.visibility_timeout_s)))
        finally:
            lease.release()  # before the delivery goes out: the task that takes it must find the lease free
        if once:
            runtime.dispatch(stage, job.id)
            requeued.append(job.id)
            log.warning("job %s: its worker stopped renewing its lease; sent to the %s queue again", job.id, stage)
    return requeued


def heartbeat_file(stage: str) -> Path:
    """Touched by a stage's worker after each sweep that reached Redis: a container's healthcheck reads its age
    (docker-compose.yml), which costs a stat where Celery's ping through the broker costs seconds of CPU."""
    return Path(tempfile.gettempdir()) / f"eyas-worker-{stage}.alive"


def _sweep_forever(stage: str) -> None:
    runtime = service_runtime(get_service_settings())
    stop = threading.Event()
    while not stop.wait(runtime.settings.lease_sweep_s):
        try:
            requeue_orphans(runtime, stage)
            heartbeat_file(stage).touch()
        except Exception:  # Redis briefly away: the next sweep tries again
            log.exception("sweep for orphaned %s jobs failed", stage)


def run_worker(stage: str, concurrency: int = 1) -> None:
    """Consume `stage`'s queue with `concurrency` pool processes until stopped (SIGTERM: finish, then exit)."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: stages are {list(STAGES)}")
    get_stage(stage)  # import the stage (torch, transformers) once, before the pool processes fork

    @worker_ready.connect(weak=False)
    def _start_sweep(**_kwargs) -> None:  # in the worker's main process, once its pool has forked
        threading.Thread(target=_sweep_forever, args=(stage,), name="eyas-sweep", daemon=True).start()

    app.worker_main(argv=[
        "worker", f"--queues={stage}", f"--concurrency={concurrency}", "--pool=prefork",
        f"--hostname={stage}-{os.getpid()}@%h", "--loglevel=INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ])

"""The Celery app of the service mode: one queue per stage (generate, extract, train, evaluate) on Redis, and
at-least-once delivery.

Delivery guarantees, and the kombu 5.7 Redis-transport options behind them (kombu/transport/redis.py):
  - task_acks_late: a task is acknowledged when it has finished, not when it is received, so a task whose worker
    dies is still unacknowledged and runs again. Every stage is idempotent (deterministic artifact prefix, the
    manifest is the commit marker: see orchestration.execution.execute), so running twice writes the artifact once.
  - task_reject_on_worker_lost: if the pool process running a task dies (SIGKILL, OOM), the worker requeues the
    task at once instead of marking it failed.
  - worker_prefetch_multiplier=1: a worker holds no more tasks than it has pool processes; a long task never keeps
    a second one waiting behind it while other workers are idle.
  - visibility_timeout: an unacknowledged delivery older than this goes back to its queue (QoS.restore_visible),
    whether its worker died or its task is merely long, so it is set far beyond any lease (BROKER_VISIBILITY_S):
    the project's own leases (orchestration.lease) tell a live task from a dead one. A task holds its job's lease
    while it runs, and a worker's sweep (orchestration.tasks) requeues a running job whose lease nobody holds,
    within settings.visibility_timeout_s of its worker's death. The broker's restore is left as the backstop for a
    delivery whose worker died before its task took the lease; a delivery of a job whose lease is held is dropped.
  - unacked_restore_interval (seconds between restore sweeps, default 10) and unacked_restore_throttle (scan on
    every Nth sweep, default 10): the defaults sweep every ~100 s; 1 makes the interval the whole period.
    unacked_mutex_expire (default 300 s): the lock a sweep holds; one left by a killed worker expires sooner.
"""
from __future__ import annotations

from celery import Celery
from kombu import Queue

from eyas.settings import Settings
from orchestration.registry import STAGE_ORDER, STAGES
from orchestration.settings import ServiceSettings

TASK = "eyas.run_job"  # run_job(job_id), routed to the job's stage queue
ASSIST_TASK = "eyas.assist_job"  # assist_job(job_id, attempt, index, ids): a chunk of a running job's work


BROKER_VISIBILITY_S = 12 * 3600


def make_celery(settings: Settings) -> Celery:
    settings = ServiceSettings.of(settings)
    app = Celery("eyas", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_queues=[Queue(stage, routing_key=stage) for stage in STAGES],
        task_default_queue=STAGE_ORDER[0],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={
            "visibility_timeout": BROKER_VISIBILITY_S,
            "unacked_restore_interval": settings.lease_sweep_s,
            "unacked_restore_throttle": 1,
            # a worker killed inside a sweep leaves the sweep's lock behind; it blocks other sweeps this long
            "unacked_mutex_expire": 30,
        },
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # job state lives in the job store, not in a result backend
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


def celery_dispatch(app: Celery):
    """The service mode's dispatcher: schedule `execute(job_id)` on the stage's queue."""

    def dispatch(stage: str, job_id: str) -> None:
        if stage not in STAGES:
            raise KeyError(f"no queue for stage {stage!r}")
        app.send_task(TASK, args=[job_id], queue=stage, routing_key=stage)

    return dispatch


def celery_send_chunk(app: Celery):
    """Send a chunk of a running job's work (orchestration.workshare) to the stage's queue as a task of its own."""

    def send(stage: str, job_id: str, attempt: int, index: int, ids: list[str]) -> None:
        app.send_task(ASSIST_TASK, args=[job_id, attempt, index, ids], queue=stage, routing_key=stage)

    return send

"""The job state machine and the two job stores (SQLite for embedded mode, a real Redis for service mode)."""
from __future__ import annotations

import itertools
import threading

import pytest

from orchestration.jobs import (
    ALLOWED,
    IllegalTransition,
    JobNotFound,
    JobRecord,
    RedisJobStore,
    SqliteJobStore,
    new_job_id,
    next_job_id,
    transition,
    update,
)

_ns = itertools.count()


@pytest.fixture(params=["sqlite", "redis"])
def jobs(request, tmp_path):
    if request.param == "sqlite":
        return SqliteJobStore(tmp_path / "jobs.sqlite")
    return RedisJobStore(request.getfixturevalue("redis_url"), namespace=f"test-jobs-{next(_ns)}")


def _new(jobs, stage: str = "generate", **fields) -> JobRecord:
    job = JobRecord(id=new_job_id(stage), stage=stage, spec={"prompts": "p.jsonl"}, **fields)
    jobs.put(job)
    return job


def test_happy_path_and_redelivery(jobs):
    job = _new(jobs)
    assert transition(jobs, job.id, "running", attempts=1).state == "running"
    again = transition(jobs, job.id, "running", attempts=2)  # a redelivered task picks it up again
    assert again.attempts == 2
    done = transition(jobs, job.id, "succeeded", artifacts={"output": "s3://b/datasets/x"},
                      progress={"done": 3, "total": 3, "unit": "prompts"})
    assert jobs.get(job.id) == done
    assert done.progress.done == 3 and done.artifacts == {"output": "s3://b/datasets/x"}
    assert done.updated_at >= job.updated_at


@pytest.mark.parametrize("path", [
    ("succeeded", "running"), ("failed", "running"), ("cancelled", "running"), ("succeeded", "failed"),
    ("cancelled", "succeeded"), ("queued", "succeeded"), ("queued", "queued"), ("running", "queued"),
])
def test_illegal_transitions_are_refused_and_change_nothing(jobs, path):
    start, illegal = path
    job = _new(jobs)
    if start != "queued":
        if start in ("succeeded",):
            transition(jobs, job.id, "running")
        transition(jobs, job.id, start)
    before = jobs.get(job.id)
    with pytest.raises(IllegalTransition, match=f"{start} → {illegal}"):
        transition(jobs, job.id, illegal, error="should not be written")
    assert jobs.get(job.id) == before


def test_state_machine_table():
    # terminal states are final; nothing goes back to queued
    assert ALLOWED["succeeded"] == ALLOWED["failed"] == ALLOWED["cancelled"] == frozenset()
    assert all("queued" not in targets for targets in ALLOWED.values())


def test_a_pipelines_jobs_share_one_key_and_name_their_stage():
    first = new_job_id("generate")
    stage, key = first.split("-", 1)
    assert stage == "gen" and len(key) == 12 and new_job_id("generate") != first
    assert next_job_id(first, "extract") == f"ext-{key}"
    assert next_job_id(next_job_id(first, "extract"), "train") == f"tra-{key}"  # a redelivery derives the same id


def test_unknown_job(jobs):
    with pytest.raises(JobNotFound):
        jobs.get("gen-000000000000")
    with pytest.raises(JobNotFound):
        transition(jobs, "gen-000000000000", "running")


def test_list_filters_and_counts(jobs):
    made = [_new(jobs, "generate", created_at=float(i)) for i in range(5)]
    ext = _new(jobs, "extract", created_at=10.0)
    transition(jobs, made[1].id, "cancelled")
    transition(jobs, made[3].id, "running")
    assert [j.id for j in jobs.list("generate")] == [j.id for j in reversed(made)]  # newest first
    assert [j.id for j in jobs.list("generate", limit=2)] == [made[4].id, made[3].id]
    assert [j.id for j in jobs.list("generate", state="queued")] == [made[4].id, made[2].id, made[0].id]
    assert [j.id for j in jobs.list("generate", state="queued", limit=1)] == [made[4].id]
    assert [j.id for j in jobs.list(state="queued")] == [ext.id, made[4].id, made[2].id, made[0].id]
    assert jobs.counts() == {("generate", "queued"): 3, ("generate", "cancelled"): 1,
                             ("generate", "running"): 1, ("extract", "queued"): 1}


def test_concurrent_writers_lose_nothing(jobs):
    """A worker's progress writes and an API's cancel race on one record: every change must land."""
    job = _new(jobs)
    transition(jobs, job.id, "running")

    def bump(key: str, n: int):
        for _ in range(n):
            jobs.mutate(job.id,
                        lambda j: j.model_copy(update={"metrics": {**j.metrics, key: j.metrics.get(key, 0) + 1}}))

    threads = [threading.Thread(target=bump, args=(k, 60)) for k in ("a", "b", "c")]
    for t in threads:
        t.start()
    update(jobs, job.id, cancel_requested=True)
    for t in threads:
        t.join()
    final = jobs.get(job.id)
    assert final.metrics == {"a": 60, "b": 60, "c": 60}
    assert final.cancel_requested and final.state == "running"


def test_a_job_whose_worker_keeps_dying_fails_saying_so(tmp_path):
    """A run that its worker did not survive leaves the job "running"; the run that finds EYAS_MAX_JOB_RUNS of those
    behind it fails the job with the reason (an OOM-killed worker would otherwise be fed the same job forever)."""
    from eyas.store import LocalStore
    from orchestration.execution import execute
    from orchestration.settings import ServiceSettings

    jobs = SqliteJobStore(tmp_path / "jobs.sqlite")
    settings = ServiceSettings(workdir=tmp_path, max_job_runs=2)
    job = _new(jobs)
    transition(jobs, job.id, "running", attempts=2, worker="host-a:7")  # two runs, each ended by its worker's death
    done = execute(job.id, jobs, LocalStore(tmp_path / "store"), settings, dispatch=lambda *_: None)
    assert done.state == "failed" and done.attempts == 2
    assert "died during each of its 2 runs (the last on host-a:7)" in done.error and "memory" in done.error


def test_a_progress_report_outlives_a_job_store_outage(monkeypatch):
    """A Redis restart longer than the client's retries, during a progress report: the stage goes on (the report
    returns, not raises) and the next report writes (the deploy test's Redis fault once failed a train job here)."""
    import redis.exceptions

    from orchestration import execution

    calls = []

    def update(jobs, job_id, **fields):
        calls.append(fields["progress"].done)
        if len(calls) == 1:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:16379. Connection refused.")
        return type("Job", (), {"cancel_requested": False})()

    monkeypatch.setattr(execution, "update", update)
    report = execution._job_reporter(None, "tra-1")
    assert report(1, 10, "steps", {}) is False and report(2, 10, "steps", {}) is False
    assert calls == [1, 2]

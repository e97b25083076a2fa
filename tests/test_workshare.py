"""Work shared by chunk tasks and held under leases (orchestration.workshare, orchestration.lease) on a real Redis:
the run and its helpers never hand out an id twice, a helper SIGKILLed while it holds a chunk loses nothing (the
run takes the chunk over once the lease lapses, skipping what the helper had finished), and a worker's sweep sends
a running job whose lease nobody holds to its queue again, once per attempt."""
from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time

import redis

from orchestration.coordination import coordination_for
from orchestration.jobs import JobRecord, RedisJobStore, transition
from orchestration.lease import Leases, job_lease
from orchestration.runtime import Runtime
from orchestration.settings import ServiceSettings
from orchestration.tasks import requeue_orphans
from orchestration.workshare import ORDERED, ChunkWork, cut_chunks, ordered_chunks, share_by_tasks

_jobs = itertools.count()


def _drain(work) -> list[str]:
    ids = []
    while (i := work.claim()) is not None:
        ids.append(i)
    return ids


def test_chunks_balance_participants_and_keep_a_minimum():
    ids = [f"p{i}" for i in range(100)]
    chunks = cut_chunks(ids, helpers=3, min_chunk=2)
    assert sum(chunks, []) == ids and len(chunks) == 8  # about two per participant
    assert [len(c) for c in cut_chunks(ids, helpers=3, min_chunk=40)] == [40, 40, 20]


def test_run_and_helpers_share_chunks_without_handing_out_an_id_twice(redis_url):
    client = redis.Redis.from_url(redis_url)
    leases = Leases(client, lease_s=5.0)
    sent: list[tuple] = []
    job, ids = f"job-{next(_jobs)}", [f"p{i}" for i in range(20)]
    run = share_by_tasks(client, leases, lambda *args: sent.append(args), "generate", job, 1, ids, helpers=1,
                         min_chunk=2)
    assert [s[3] for s in sent] == [0, 1, 2]  # every chunk but the run's own first (the last) went to the queue
    helper = ChunkWork(client, Leases(client, lease_s=5.0), job, 1, {0: sent[0][4]}, owner=False)
    first = _drain(helper)
    assert first == sent[0][4]
    assert _drain(ChunkWork(client, leases, job, 1, {0: sent[0][4]}, owner=False)) == []  # held: nothing to do
    own = _drain(run)  # the run takes every chunk nobody holds, last first
    assert own[:5] == ids[15:] and not set(own) & set(first) and sorted(own + first) == sorted(ids)
    assert run.open_count() == 20
    run.finished(own)
    assert run.open_count() == len(first)  # the helper's chunk is still open
    helper.finished(first)
    helper.close()
    assert run.open_count() == 0 and run.finished_count() == 20
    run.close()
    assert not client.keys(f"eyas:work:{job}:*")  # the run leaves nothing behind


_HELPER = """
import sys, time, redis
from orchestration.lease import Leases
from orchestration.workshare import ChunkWork
client = redis.Redis.from_url(sys.argv[1])
work = ChunkWork(client, Leases(client, lease_s=1.0), sys.argv[2], 1, {0: ["a", "b", "c"]}, owner=False)
work.finished([work.claim()])
print(work.claim(), flush=True)
time.sleep(600)
"""


def test_ordered_work_is_taken_first_first_one_id_at_a_time_by_every_participant(redis_url):
    """A stream's objects: each helper's task names every id; whoever asks next gets the first id nobody holds or
    finished, so the earliest open id is always held by someone alive or free."""
    client = redis.Redis.from_url(redis_url)
    sent: list[tuple] = []
    job, ids = f"job-{next(_jobs)}", [f"o{i}" for i in range(6)]
    run = share_by_tasks(client, Leases(client, lease_s=5.0), lambda *args: sent.append(args), "extract", job, 1,
                         ids, helpers=2, min_chunk=1, ordered=True)
    assert [(s[3], s[4]) for s in sent] == [(ORDERED, ids)] * 2
    helper = ChunkWork(client, Leases(client, lease_s=5.0), job, 1, ordered_chunks(ids), owner=False, ordered=True)
    assert [run.claim(), helper.claim(), run.claim(), helper.claim()] == ids[:4]  # in order, alternating
    run.finished(["o0"])
    helper.finished(["o1"])
    assert run.open_count() == 4  # o2, o3 held; o4, o5 free
    assert run.claim() == "o4" and helper.claim() == "o5" and run.claim() is None and helper.claim() is None
    run.finished(["o2", "o4"])
    helper.finished(["o3", "o5"])
    assert run.open_count() == 0
    helper.close()
    run.close()
    alone = share_by_tasks(client, Leases(client, lease_s=5.0), lambda *args: sent.append(args), "extract",
                           f"job-{next(_jobs)}", 1, ids, helpers=0, min_chunk=1, ordered=True)
    assert _drain(alone) == ids and len(sent) == 2  # no helpers: the run's own, in order, nothing queued


def test_a_killed_helpers_chunk_is_taken_over_when_its_lease_lapses(redis_url):
    client = redis.Redis.from_url(redis_url)
    job = f"job-{next(_jobs)}"
    helper = subprocess.Popen([sys.executable, "-c", _HELPER, redis_url, job], stdout=subprocess.PIPE, text=True)
    assert helper.stdout.readline().strip() == "b"  # finished "a", holds "b" and "c"
    run = ChunkWork(client, Leases(client, lease_s=1.0), job, 1, {0: ["a", "b", "c"], 1: ["d"]}, owner=True)
    assert _drain(run) == ["d"]  # chunk 0 is held by a live helper (its lease renewed)
    time.sleep(2.0)
    assert _drain(run) == []  # still renewed: still held
    helper.send_signal(signal.SIGKILL)
    helper.wait()
    taken, deadline = [], time.monotonic() + 10
    while not taken and time.monotonic() < deadline:
        taken = _drain(run)
        time.sleep(0.1)
    assert taken == ["b", "c"]  # what the helper had finished is not done again
    run.close()


def test_the_sweep_requeues_a_running_job_whose_lease_lapsed_once_per_attempt(redis_url):
    settings = ServiceSettings(mode="service", redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    jobs = RedisJobStore(redis_url, namespace=f"test-sweep-{next(_jobs)}")
    dispatched: list[tuple[str, str]] = []
    runtime = Runtime(settings=settings, jobs=jobs, store=None, dispatch=lambda *a: dispatched.append(a),
                      coordination=coordination_for(settings), leases=Leases(client, lease_s=5.0))
    alive, orphan = (JobRecord(id=f"gen-sweep{next(_jobs)}", stage="generate", spec={}) for _ in range(2))
    for job in (alive, orphan):
        jobs.put(job)
        transition(jobs, job.id, "running", attempts=1)
    held = Leases(client, lease_s=5.0).try_hold(job_lease(alive.id))
    assert requeue_orphans(runtime, "generate") == [orphan.id]
    assert requeue_orphans(runtime, "generate") == []  # once per attempt, however long it waits in the queue
    transition(jobs, orphan.id, "running", attempts=2)  # its next run started, and its worker died too
    assert requeue_orphans(runtime, "generate") == [orphan.id]
    assert dispatched == [("generate", orphan.id)] * 2
    held.release()

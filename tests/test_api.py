"""The job API (orchestration.api.app.create_app) on real components: Redis + SeaweedFS in service mode (no worker, so
jobs
stay queued where the test can look at them), and embedded mode running jobs against a real vLLM."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr

from eyas.manifest import read_manifest
from eyas.prompts import load_eval_prompts
from eyas.settings import Settings
from eyas.store import S3Store, open_artifact
from orchestration.api.app import create_app
from orchestration.execution import validate_spec
from orchestration.jobs import JobRecord, RedisJobStore, transition
from orchestration.lease import Leases, job_lease
from orchestration.settings import ServiceSettings
from tests.conftest import ServiceEnv, wait_for_job
from tests.servers import S3_SECRET, free_port

LONG_PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a bicycle works, covering every part.",
    "Describe the water cycle in detail for a school textbook.",
    "Write a long letter to a friend about a trip to the mountains.",
    "Explain how bread is made, from wheat field to bakery shelf.",
    "Describe a busy city market in the morning, with many details.",
    "Write an essay about why people enjoy gardening.",
    "Explain how a library organizes its books, in detail.",
]


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": LONG_PROMPTS[i]}]})
                            + "\n" for i in range(n)))
    return path


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "prompts.jsonl", 4)


@pytest.fixture
def service_client(service_settings: ServiceEnv):
    with TestClient(create_app("generate", service_settings.settings)) as client:
        yield client


def _nothing_written(settings: ServiceSettings) -> None:
    assert RedisJobStore(settings.redis_url).counts() == {}
    assert redis.Redis.from_url(settings.redis_url).llen("generate") == 0
    assert S3Store(settings).list("") == []


def _metric(client: TestClient, line_start: str) -> float | None:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return None


def test_submit_get_list_cancel(service_client: TestClient, service_settings: ServiceEnv, prompts_file: Path):
    r = service_client.post("/v1/jobs", json={"prompts": str(prompts_file), "limit": 2})
    assert r.status_code == 202, r.text
    body = r.json()
    job_id = body["id"]
    assert body["status"] == "queued" and body["links"]["self"] == f"/v1/jobs/{job_id}"
    assert r.headers["location"] == f"/v1/jobs/{job_id}"
    queued = redis.Redis.from_url(service_settings.settings.redis_url).lrange("generate", 0, -1)
    assert len(queued) == 1 and job_id.encode() in queued[0]  # on the generate queue, by id only

    job = service_client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "queued" and job["stage"] == "generate" and job["attempts"] == 0
    assert job["spec"]["prompts"] == str(prompts_file) and job["spec"]["limit"] == 2
    assert job["spec"]["concurrency"] == 16  # defaults filled in: the record says exactly what will run

    second = service_client.post("/v1/jobs", json={"prompts": str(prompts_file)}).json()["id"]
    assert [j["id"] for j in service_client.get("/v1/jobs").json()] == [second, job_id]
    assert [j["id"] for j in service_client.get("/v1/jobs", params={"limit": 1}).json()] == [second]

    r = service_client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["state"] == "cancelled"
    assert service_client.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"
    assert [j["id"] for j in service_client.get("/v1/jobs", params={"state": "queued"}).json()] == [second]
    r = service_client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 409 and r.json()["detail"][0] == {
        "field": "state", "value": "cancelled", "message": f"job {job_id} has already ended"}
    assert service_client.post("/v1/jobs/gen-000000000000/cancel").status_code == 404
    assert service_client.get("/v1/jobs/gen-000000000000").json()["detail"][0]["value"] == "gen-000000000000"

    assert _metric(service_client, 'eyas_jobs_submitted_total{stage="generate"}') == 2
    assert _metric(service_client, 'eyas_jobs_cancelled_total{stage="generate"}') == 1
    assert _metric(service_client, 'eyas_jobs_active{stage="generate",state="queued"}') == 1
    assert _metric(service_client, 'eyas_http_request_duration_seconds_count{method="POST",route="/v1/jobs",'
                                   'status="202"}') == 2


BAD_SPECS = [
    # (spec given, field named, value named, words in the message)
    ({"bogus": 1}, "bogus", 1, "Extra inputs"),
    ({"concurrency": 0}, "concurrency", 0, "greater than or equal to 1"),
    ({"endpoint": "ftp://host"}, "endpoint", "ftp://host", "http:// or https://"),
    ({"endpoint": "http://10.0.0.1:8000"}, "endpoint", "http://10.0.0.1:8000", "not an allowed endpoint"),
    ({"sampling": {"temperature": -1}}, "sampling.temperature", -1, "greater than or equal to 0"),
    ({"limit": "many"}, "limit", "many", "integer"),
    ({"then": ["train"]}, "then[0]", "train", "must be extract"),
    ({"then": [{"stage": "extract", "max_length": 3}]}, "then[0].max_length", 3, "greater than or equal to 16"),
]


@pytest.mark.parametrize("extra,field,value,words", BAD_SPECS, ids=[b[1] for b in BAD_SPECS])
def test_bad_spec_names_field_and_value_and_writes_nothing(service_client, service_settings, prompts_file,
                                                           extra, field, value, words):
    r = service_client.post("/v1/jobs", json={"prompts": str(prompts_file), **extra})
    assert r.status_code == 422, r.text
    problem = r.json()["detail"][0]
    assert (problem["field"], problem["value"]) == (field, value)
    assert words in problem["message"]
    _nothing_written(service_settings.settings)
    assert _metric(service_client, 'eyas_jobs_rejected_total{stage="generate"}') == 1


BAD_FILES = [
    ("broken.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', "line 2 is not JSON"),
    ("nomsg.jsonl", b'{"text": "hi"}\n', "record 0: no 'messages', 'conversations' or 'turns' field"),
    ("role.jsonl", b'{"messages": [{"role": "robot", "content": "hi"}]}\n', "messages[0] needs role"),
    ("latin1.jsonl", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', "not UTF-8"),
    ("empty.jsonl", b"\n\n", "holds no records"),
]


@pytest.mark.parametrize("name,content,words", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_malformed_prompt_file_is_refused(service_client, service_settings, tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    r = service_client.post("/v1/jobs", json={"prompts": str(path)})
    assert r.status_code == 422, r.text
    problem = r.json()["detail"][0]
    assert (problem["field"], problem["value"]) == ("prompts", str(path))
    assert words in problem["message"]
    _nothing_written(service_settings.settings)


def test_missing_prompt_file_and_broken_body(service_client, service_settings, tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    r = service_client.post("/v1/jobs", json={"prompts": missing})
    assert r.status_code == 422 and r.json()["detail"][0]["value"] == missing
    assert "does not exist" in r.json()["detail"][0]["message"]
    r = service_client.post("/v1/jobs", content=b'{"prompts": ', headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body"
    r = service_client.post("/v1/jobs", json={})  # a rule across fields: the whole body is named
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body"
    assert "give prompts" in r.json()["detail"][0]["message"]
    r = service_client.get("/v1/jobs", params={"state": "done", "limit": 0})
    assert r.status_code == 422 and [(p["field"], p["value"]) for p in r.json()["detail"]] == [
        ("state", "done"), ("limit", "0")]
    _nothing_written(service_settings.settings)


@pytest.mark.parametrize("stage", ["generate", "extract", "train", "evaluate"])
def test_api_key(stage: str, service_settings: ServiceEnv, prompts_file: Path):
    settings = service_settings.settings.model_copy(update={"api_key": SecretStr("k3y-0123456789")})
    bucket = settings.s3_bucket
    body = {"generate": {"prompts": str(prompts_file)}, "extract": {"data": f"s3://{bucket}/datasets/x"},
            "train": {"features": f"s3://{bucket}/features/x"}, "evaluate": {"drafter": f"s3://{bucket}/drafters/x"}}[stage]
    with TestClient(create_app(stage, settings)) as client:
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.post("/v1/jobs", json=body, headers={"Authorization": "Basic k3y-0123456789"}).status_code == 401
        assert client.post("/v1/jobs", json=body, headers={"Authorization": "Bearer k3y-0123456788"}).status_code == 403
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.get("/v1/jobs/x-1", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.post("/v1/jobs/x-1/cancel").status_code == 401
        _nothing_written(settings)
        r = client.post("/v1/jobs", json=body, headers={"Authorization": "Bearer k3y-0123456789"})
        assert r.status_code == 202
        job = client.get(r.json()["links"]["self"], headers={"Authorization": "Bearer k3y-0123456789"}).json()
        assert job["state"] == "queued"
        assert "k3y-0123456789" not in json.dumps(job) and S3_SECRET not in json.dumps(job)  # no secret recorded
        assert client.get("/healthz").status_code == 200  # probes stay open
        doc = client.get("/openapi.json", headers={"Authorization": "Bearer k3y-0123456789"}).json()
        assert "/v1/jobs" in doc["paths"] and doc["paths"]["/v1/jobs"]["post"]["security"] == [{"HTTPBearer": []}]
    with TestClient(create_app(stage, service_settings.settings)) as client:  # no key: none asked, none documented
        assert "security" not in client.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]


DOCS = ("/openapi.json", "/docs", "/redoc")


def test_the_schema_and_docs_want_the_key(service_settings: ServiceEnv):
    """The schema shows the operator's settings (the bucket, input roots, allowed endpoints and caps in its patterns
    and maximums): with a key, it and the pages that show it want the key, as a bearer token or, from a browser,
    as HTTP Basic's password; without one they are open."""
    key = "k3y-0123456789"
    settings = service_settings.settings.model_copy(update={"api_key": SecretStr(key)})
    with TestClient(create_app("extract", settings)) as client:
        for path in DOCS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Token {key}"}):
                r = client.get(path, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic "), (path, headers)
                assert settings.s3_bucket not in r.text
            assert client.get(path, auth=("anyone", "wrong")).status_code == 401
            assert client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, path
            assert client.get(path, auth=("anyone", key)).status_code == 200, path  # what a browser sends
        data = client.get("/openapi.json", auth=("", key)).json()["components"]["schemas"]["Spec"]["properties"]["data"]
        assert re.fullmatch(data["pattern"], f"s3://{settings.s3_bucket}/datasets/x")  # the bucket: what the key guards
        assert not re.fullmatch(data["pattern"], "s3://another-bucket/datasets/x")
        assert client.get("/healthz").status_code == 200  # probes stay open
    with TestClient(create_app("extract", service_settings.settings)) as client:  # no key: open
        for path in DOCS:
            assert client.get(path).status_code == 200, path


def test_each_service_answers_for_its_own_stage_jobs_only(service_settings: ServiceEnv, prompts_file: Path):
    """The services share one job store: a generate job (queued, then running) is absent to the extract service —
    read and cancel are 404s, its list leaves it out, and the job is untouched — and the other way round."""
    settings, bucket = service_settings.settings, service_settings.settings.s3_bucket
    jobs = RedisJobStore(settings.redis_url)
    with TestClient(create_app("generate", settings)) as gen, TestClient(create_app("extract", settings)) as ext:
        gen_id = gen.post("/v1/jobs", json={"prompts": str(prompts_file)}).json()["id"]
        ext_id = ext.post("/v1/jobs", json={"data": f"s3://{bucket}/datasets/x"}).json()["id"]
        for state in ("queued", "running"):
            if state == "running":
                transition(jobs, gen_id, "running")
            for client, own, other in ((gen, gen_id, ext_id), (ext, ext_id, gen_id)):
                r = client.get(f"/v1/jobs/{other}")
                assert r.status_code == 404 and r.json()["detail"][0]["value"] == other
                assert client.post(f"/v1/jobs/{other}/cancel").status_code == 404
                assert [j["id"] for j in client.get("/v1/jobs").json()] == [own]
                assert client.get(f"/v1/jobs/{own}").status_code == 200
            assert jobs.get(gen_id).state == state and not jobs.get(gen_id).cancel_requested
        assert jobs.get(ext_id).state == "queued" and not jobs.get(ext_id).cancel_requested
        assert gen.post(f"/v1/jobs/{gen_id}/cancel").status_code == 202  # its own service cancels it
        assert jobs.get(gen_id).cancel_requested


def test_oversized_body_is_refused_unread(service_client: TestClient, service_settings: ServiceEnv):
    body = json.dumps({"prompts": "x", "model": "m" * (2 << 20)})
    r = service_client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limited to 1048576 bytes" in r.json()["detail"][0]["message"]
    # without a Content-Length (chunked): refused once the streamed bytes pass the limit
    chunks = (body[i:i + 65536].encode() for i in range(0, len(body), 65536))
    r = service_client.post("/v1/jobs", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limited to 1048576 bytes" in r.json()["detail"][0]["message"]
    _nothing_written(service_settings.settings)


@pytest.mark.parametrize("stage", ["generate", "extract", "train", "evaluate", "diagnose"])
def test_every_number_has_a_documented_bound(stage: str):
    from orchestration.registry import get_stage

    def numbers(node, where=""):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                yield where, node
            for key, value in node.items():
                yield from numbers(value, f"{where}.{key}")
        elif isinstance(node, list):
            for value in node:
                yield from numbers(value, where)

    schema = get_stage(stage).spec_cls.model_json_schema()
    models = [schema, *schema.get("$defs", {}).values()]  # their fields (not the rules across them)
    found = [n for m in models for n in numbers(m["properties"], m.get("title", ""))]
    assert found and [w for w, n in found if "maximum" not in n and "exclusiveMaximum" not in n] == []


def test_repeated_query_parameters_are_all_read_and_deep_bodies_are_named(service_client: TestClient,
                                                                          service_settings: ServiceEnv,
                                                                          prompts_file: Path):
    r = service_client.get("/v1/jobs?state=bogus&state=queued")  # every value is validated, not only the last
    assert r.status_code == 422 and [(p["field"], p["value"]) for p in r.json()["detail"]] == [("state", "bogus")]
    r = service_client.get("/v1/jobs?limit=5&limit=6")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "limit"
    assert r.json()["detail"][0]["message"] == "give limit once"
    queued = service_client.post("/v1/jobs", json={"prompts": str(prompts_file)}).json()["id"]
    assert [j["id"] for j in service_client.get("/v1/jobs?state=running&state=queued").json()] == [queued]
    assert service_client.get("/v1/jobs?state=running").json() == []
    deep = b'{"prompts": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = service_client.post("/v1/jobs", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "body"
    assert "nests deeper" in r.json()["detail"][0]["message"], r.text


def test_evaluate_reads_prompt_files_from_the_bucket(service_settings: ServiceEnv, prompts_file: Path):
    store = S3Store(service_settings.settings)
    store.ensure_bucket()
    store.put_file("inputs/eval.jsonl", prompts_file)
    uri = store.uri("inputs/eval.jsonl")
    spec = validate_spec("evaluate", {"drafter": store.uri("drafters/x"), "prompts": uri, "second_prompts": uri},
                         service_settings.settings)
    assert spec.prompts == uri
    prompts = load_eval_prompts(uri, 2, service_settings.settings)
    assert [p.user_turns for p in prompts] == [p.user_turns for p in load_eval_prompts(str(prompts_file), 2)]


def test_a_running_jobs_worker_is_named_and_an_orphan_is_marked(service_client: TestClient,
                                                                service_settings: ServiceEnv):
    jobs = RedisJobStore(service_settings.settings.redis_url)
    jobs.put(JobRecord(id="gen-orphan1", stage="generate", spec={}))
    assert service_client.get("/v1/jobs/gen-orphan1").json()["liveness"] is None  # queued: nobody holds it yet
    transition(jobs, "gen-orphan1", "running", attempts=1, worker="node-3:4242")
    job = service_client.get("/v1/jobs/gen-orphan1").json()
    assert (job["worker"], job["liveness"]) == ("node-3:4242", "orphaned")  # nobody renews its lease
    lease = Leases(redis.Redis.from_url(service_settings.settings.redis_url), 30).try_hold(job_lease("gen-orphan1"))
    assert service_client.get("/v1/jobs/gen-orphan1").json()["liveness"] == "alive"
    assert [j["liveness"] for j in service_client.get("/v1/jobs?state=running").json()] == ["alive"]
    lease.release()


def test_unknown_query_parameters_are_named(service_client: TestClient):
    r = service_client.get("/v1/jobs?stat=failed")
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "stat"
    assert "['limit', 'state']" in r.json()["detail"][0]["message"]


def test_readiness(service_client: TestClient, service_settings: ServiceEnv):
    r = service_client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"broker": "ok", "jobs": "ok", "store": "ok"}
    dead = service_settings.settings.model_copy(update={
        "redis_url": f"redis://127.0.0.1:{free_port()}/0", "s3_bucket": "no-such-bucket"})
    with TestClient(create_app("generate", dead)) as client:
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["checks"] == {"broker": "down", "jobs": "down", "store": "down"}  # what, not where
        assert "127.0.0.1" not in r.text and "no-such-bucket" not in r.text
        assert client.get("/healthz").status_code == 200


@pytest.mark.vllm
def test_embedded_api_runs_and_cancels_jobs(tmp_path: Path, vllm_url: str):
    settings = Settings(mode="embedded", workdir=tmp_path / "work", input_roots=[tmp_path])
    prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
    with TestClient(create_app("generate", settings)) as client:
        assert client.get("/readyz").json()["checks"] == {"executor": "ok", "jobs": "ok", "store": "ok"}
        spec = {"prompts": str(prompts), "endpoint": vllm_url, "limit": 3, "concurrency": 3,
                "sampling": {"max_tokens": 16}}
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        job = wait_for_job(lambda: client.get(f"/v1/jobs/{job_id}").json(),
                           lambda j: j["state"] not in ("queued", "running"))
        assert job["state"] == "succeeded", job
        assert job["progress"] == {"done": 3, "total": 3, "unit": "prompts"}
        assert job["metrics"]["completed"] == 3 and job["attempts"] == 1
        manifest = read_manifest(open_artifact(job["artifacts"]["output"]), kind="dataset")
        assert manifest.counts["conversations"] == 3 and manifest.id == job_id

        # a running job stops within about a second of a cancel (orchestration.cancel_watch)
        slow = {**spec, "limit": 8, "concurrency": 1, "sampling": {"max_tokens": 32}}
        slow_id = client.post("/v1/jobs", json=slow).json()["id"]
        wait_for_job(lambda: client.get(f"/v1/jobs/{slow_id}").json(),
                     lambda j: j["state"] == "running" and j["progress"]["done"] >= 1)
        r = client.post(f"/v1/jobs/{slow_id}/cancel")
        assert r.status_code == 202 and r.json()["cancel_requested"]
        job = wait_for_job(lambda: client.get(f"/v1/jobs/{slow_id}").json(),
                           lambda j: j["state"] not in ("queued", "running"))
        assert job["state"] == "cancelled" and job["progress"]["done"] < 8
        assert not (settings.store_root / "datasets" / slow_id / "manifest.json").exists()
        assert _metric(client, 'eyas_jobs_succeeded_total{stage="generate"}') == 1
        assert _metric(client, 'eyas_jobs_cancelled_total{stage="generate"}') == 1


def test_metrics_expose_running_jobs_numbers(service_client: TestClient, service_settings: ServiceEnv,
                                             prompts_file: Path):
    from orchestration.jobs import transition, update

    job_id = service_client.post("/v1/jobs", json={"prompts": str(prompts_file)}).json()["id"]
    jobs = RedisJobStore(service_settings.settings.redis_url)
    transition(jobs, job_id, "running")
    update(jobs, job_id, metrics={"concurrency": 5.5, "in_flight": 3, "retried": 2, "note": "text"})
    assert _metric(service_client, f'eyas_job_metric{{job="{job_id}",name="concurrency",stage="generate"}}') == 5.5
    assert _metric(service_client, f'eyas_job_metric{{job="{job_id}",name="in_flight",stage="generate"}}') == 3.0
    assert 'name="note"' not in service_client.get("/metrics").text

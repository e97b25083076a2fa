"""Hostile input, as someone holding a valid API key would send it, against the four stage APIs in service mode
(uvicorn over real sockets, real Redis and SeaweedFS, and a generator worker, so a job that got through would run):
local files (absolute paths, traversal, symlinks out of the input root, /proc and devices), other buckets, SSRF
targets (link-local metadata, Redis, loopback in other spellings), credentials in URIs, CRLF, other schemes,
bodies over the limit (chunked too), non-finite and huge numbers.

Every one is refused with a 4xx that names the field (none gets a 2xx, none a 5xx), a refused path reads the same
whether or not the file exists, and a marker file outside the input root never reaches the endpoint the jobs may
use (a loopback server that records what it receives) — neither through the API nor through a job record that
reaches the queue another way (the worker checks the spec again). A job inside the rules, meanwhile, does reach
it. No job record or answer carries a credential.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from eyas.store import S3Store
from orchestration.celery_app import celery_dispatch, make_celery
from orchestration.jobs import JobRecord, RedisJobStore
from orchestration.registry import STAGE_ORDER
from tests.conftest import wait_for_job
from tests.servers import S3_ACCESS, S3_SECRET

pytestmark = pytest.mark.timeout(600)

MARKER = f"EYAS-MARKER-{uuid.uuid4().hex}"  # the content of the file no job may read
CONTROL = "Name three colours of the rainbow."  # the content of the file jobs may read
API_KEY = "hostile-test-key-0123456789"


class _Recorder(BaseHTTPRequestHandler):
    received: list[bytes]

    def _record(self) -> bytes:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.received.append(f"{self.command} {self.path}\n{self.headers}".encode() + body)
        return body

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self._record()
        if not self.path.endswith("/chat/completions"):
            self.send_error(404)
            return
        answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Red, green, blue."},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 5}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[tuple[str, list[bytes]]]:
    """The one endpoint jobs may use: a loopback OpenAI-style server that records every request it receives."""
    received: list[bytes] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Recorder", (_Recorder,), {"received": received}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def _prompts(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def test_hostile_requests_are_refused_and_nothing_leaves_the_roots(service_settings, api_process, worker_process,
                                                                   tmp_path, endpoint):
    url, received = endpoint
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    good = _prompts(allowed / "prompts.jsonl", CONTROL)
    secret = _prompts(outside / "secret.jsonl", MARKER)
    (allowed / "link.jsonl").symlink_to(secret)
    (allowed / "linkdir").symlink_to(outside, target_is_directory=True)
    os.mkfifo(allowed / "fifo.jsonl")  # opening it for reading would block a check that waits for a writer
    bucket = service_settings.settings.s3_bucket
    other = f"{bucket}-other"
    other_store = S3Store(service_settings.settings, bucket=other)
    other_store.ensure_bucket()
    other_store.put_file("secret.jsonl", secret)
    env = {**service_settings.env, "EYAS_INPUT_ROOTS": str(allowed), "EYAS_ALLOWED_ENDPOINTS": url,
           "EYAS_API_KEY": API_KEY}
    service = dataclasses.replace(service_settings, env=env)
    apis = {stage: api_process(stage, service) for stage in STAGE_ORDER}
    worker_process("generate", service)
    clients = {stage: httpx.Client(base_url=api.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"})
               for stage, api in apis.items()}
    redis_port = service_settings.settings.redis_url.rsplit(":", 1)[1].split("/")[0]
    s3_host = service_settings.settings.s3_endpoint
    host = url.removeprefix("http://")

    statuses: Counter = Counter()
    answers: list[tuple[str, Any, int, str]] = []

    def send(stage: str, body: dict | bytes, what: Any, field: str | None) -> httpx.Response:
        """POST a job; it must be refused with a 4xx (naming `field` when given)."""
        content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        r = clients[stage].post("/v1/jobs", content=content, headers={"content-type": "application/json"})
        statuses[r.status_code] += 1
        answers.append((stage, what, r.status_code, r.text))
        assert 400 <= r.status_code < 500, (stage, what, r.status_code, r.text[:500])
        if field is not None:
            assert field in {p["field"] for p in r.json()["detail"]}, (stage, what, r.text[:500])
        return r

    # --- local files and objects: every field that names one, every way out of the root
    escapes = [
        "/etc/passwd", "/etc/shadow", "/proc/self/mem", "/proc/self/environ", "/dev/zero", "/dev/urandom",
        str(secret), str(outside / "no-such-file.jsonl"), f"{allowed}/../outside/secret.jsonl",
        str(allowed / "link.jsonl"), str(allowed / "linkdir" / "secret.jsonl"), "pending/../../etc/passwd",
        "pending", "../../../etc/passwd", "secret.jsonl", "", ".", "~/.ssh/id_rsa", "//etc/passwd",
        "file:///etc/passwd", f"file://{secret}", f"{allowed}/./prompts.jsonl", "bundled:../../etc/passwd",
        f"s3://{other}/secret.jsonl", f"s3://{S3_ACCESS}:{S3_SECRET}@{bucket}/x", f"s3://{bucket}/../{other}/x",
        f"s3://{bucket}", f"s3://{bucket}/a//b", "s3://", f"S3://{other}/secret.jsonl",
        f"s3://{bucket}/x\r\nX-Injected: 1", "http://169.254.169.254/latest/meta-data/", "\\\\host\\share\\x",
    ]
    fields = [("generate", "prompts", {}), ("generate", "held_out", {"synthesize": 2}),
              ("generate", "mix.0.prompts", {"limit": 2}), ("generate", "target", {"prompts": str(good)}),
              ("extract", "data", {}), ("extract", "target", {"data": f"s3://{bucket}/datasets/x"}),
              ("train", "features", {}), ("train", "resume", {"features": f"s3://{bucket}/features/x"}),
              ("train", "target", {"features": f"s3://{bucket}/features/x"}), ("evaluate", "drafter", {}),
              ("evaluate", "features", {"drafter": f"s3://{bucket}/drafters/x"}),
              ("evaluate", "prompts", {"drafter": f"s3://{bucket}/drafters/x"}),
              ("evaluate", "target", {"drafter": f"s3://{bucket}/drafters/x"})]
    messages: dict[str, set[str]] = {}
    for stage, field, base in fields:
        for value in escapes:
            body = {**base, "mix": [{"prompts": value}]} if field.startswith("mix") else {**base, field: value}
            r = send(stage, body, value, field)
            if value in (str(secret), str(outside / "no-such-file.jsonl")):
                messages.setdefault(f"{stage}.{field}", set()).add(r.json()["detail"][0]["message"])
    # no existence oracle: a file outside the root that exists and one that does not are refused alike
    assert messages and all(len(m) == 1 for m in messages.values()), messages
    # `then` entries are checked like jobs, and may not set their input (the output of the stage before)
    for then in ([{"stage": "extract", "data": str(secret)}], [{"stage": "extract", "target": str(outside)}],
                 ["extract", {"stage": "train", "resume": f"s3://{other}/drafters/x"}],
                 ["extract", "train", {"stage": "evaluate", "prompts": str(secret)}],
                 ["extract", "train", {"stage": "evaluate", "endpoint": "http://169.254.169.254/"}]):
        send("generate", {"prompts": str(good), "then": then}, then, None)
    # in the root, but no prompt file: refused at once (a FIFO does not hold the check; a name too long is a 422)
    for value in (str(allowed / "fifo.jsonl"), f"{allowed}/{'a' * 300}.jsonl", str(allowed), str(allowed / "no")):
        send("generate", {"prompts": value}, value, "prompts")

    # --- endpoints: only the allowed one, only http(s), never with credentials, CR/LF, query or fragment
    ssrf = [
        "http://169.254.169.254/latest/meta-data/", "http://[fd00:ec2::254]/", "http://metadata.google.internal/",
        "http://127.0.0.1:6379", "http://localhost:6379", f"http://127.0.0.1:{redis_port}", f"http://{s3_host}",
        "http://0.0.0.0:8000", "http://[::1]:6379", "http://2130706433:6379", "http://0x7f.1:6379",
        f"{url}\r\nX-Injected: 1", f"{url}/\r\n", f"{url}/%0d%0aX-Injected:%201", "file:///etc/passwd",
        "gopher://127.0.0.1:6379/_INFO", "dict://127.0.0.1:6379/", "ftp://127.0.0.1/",
        f"http://user:pass@{host}", f"http://{API_KEY}@{host}", f"{url}?api_key=abc", f"{url}#frag",
        f"{url}/../admin", "HTTP://127.0.0.1:6379", f" {url}", url.replace("http://", "https://") + "9",
        f"{url}@evil.example", f"http://evil.example#@{host}", "http://" + "a" * 5000,
        f"http://user:pass@{host}/" + "a" * 5000,
    ]
    for stage, field in (("generate", "endpoint"), ("evaluate", "endpoint"), ("evaluate", "spec_endpoint")):
        base = {"prompts": str(good)} if stage == "generate" else {"drafter": f"s3://{bucket}/drafters/x"}
        for value in ssrf:
            send(stage, {**base, field: value}, value, field)

    # --- non-finite and huge numbers
    raw = [
        ("generate", '{"prompts": "%s", "sampling": {"temperature": %s}}', "sampling.temperature"),
        ("generate", '{"prompts": "%s", "sampling": {"top_p": %s}}', "sampling.top_p"),
        ("generate", '{"prompts": "%s", "request_timeout_s": %s}', "request_timeout_s"),
        ("generate", '{"prompts": "%s", "latency_factor": %s}', "latency_factor"),
        ("generate", '{"mix": [{"prompts": "%s", "weight": %s}], "limit": 2}', "mix.0.weight"),
        ("generate", '{"prompts": "%s", "sampling": {"chat_template_kwargs": {"x": %s}}}',
         "sampling.chat_template_kwargs.x"),
        ("generate", '{"prompts": "%s", "then": ["extract", {"stage": "train", "lr": %s}]}', "then[1].lr"),
    ]
    for stage, template, field in raw:
        for number in ("NaN", "Infinity", "-Infinity", "1e400"):
            send(stage, (template % (good, number)).encode(), f"{field}={number}", field)
    for stage, template, field in (("train", '{"features": "s3://%s/f/x", "lr": %s}', "lr"),
                                   ("train", '{"features": "s3://%s/f/x", "epochs": %s}', "epochs"),
                                   ("evaluate", '{"drafter": "s3://%s/d/x", "k": %s}', "k"),
                                   ("extract", '{"data": "s3://%s/d/x", "max_length": %s}', "max_length")):
        for number in ("NaN", "Infinity", "-Infinity"):
            send(stage, (template % (bucket, number)).encode(), f"{field}={number}", field)
    huge = [("generate", {"prompts": str(good), "limit": 1e30}, "limit"),
            ("generate", {"prompts": str(good), "limit": 10 ** 30}, "limit"),
            ("generate", {"prompts": str(good), "concurrency": 10 ** 100}, "concurrency"),
            ("generate", {"prompts": str(good), "sampling": {"max_tokens": 2 ** 64}}, "sampling.max_tokens"),
            ("generate", {"prompts": str(good), "synth_seed": 2 ** 70}, "synth_seed"),
            ("generate", {"mix": [{"prompts": "synth"}] * 10_000, "limit": 2}, "mix"),
            ("train", {"features": f"s3://{bucket}/f/x", "draft_vocab_size": 10 ** 12}, "draft_vocab_size"),
            ("train", {"features": f"s3://{bucket}/f/x", "steps": 10 ** 19}, "steps"),
            ("train", {"features": f"s3://{bucket}/f/x", "epochs": 1e308}, "epochs"),
            ("extract", {"data": f"s3://{bucket}/d/x", "aux_layers": list(range(100_000))}, "aux_layers"),
            ("extract", {"data": f"s3://{bucket}/d/x", "batch_tokens": 10 ** 15}, "batch_tokens"),
            ("evaluate", {"drafter": f"s3://{bucket}/d/x", "batch_tokens": 10 ** 15}, "batch_tokens")]
    for stage, body, field in huge:
        send(stage, body, field, field)

    # --- bodies over the limit, with and without a Content-Length, over real sockets
    for stage, client in clients.items():
        chunked = (b'{"prompts": "' + b"a" * (1 << 20) if i == 0 else b"a" * (1 << 20) for i in range(8))
        for content in (chunked, b'{"prompts": "' + b"a" * (5 << 20) + b'"}'):
            r = client.post("/v1/jobs", content=content, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            assert r.status_code == 413 and len(r.content) < 4096, (stage, r.status_code, r.text[:300])
        r = client.options("/v1/jobs")
        assert r.status_code == 204 and r.headers["allow"] == "GET, HEAD, POST"

    # --- a job inside the rules runs and reaches the endpoint: the channel the refusals closed is real
    control = clients["generate"].post("/v1/jobs", json={"prompts": str(good), "endpoint": url, "held_out": None,
                                                         "max_turns": 1, "sampling": {"max_tokens": 8}})
    assert control.status_code == 202, control.text
    # --- a record that reached the queue without the API: the worker checks its spec again and runs nothing
    jobs = RedisJobStore(service_settings.settings.redis_url)
    dispatch = celery_dispatch(make_celery(service.settings))
    injected = {"gen-000000000001": ({"prompts": str(secret), "endpoint": url, "held_out": None}, "prompts"),
                "gen-000000000002": ({"prompts": str(good), "endpoint": f"http://127.0.0.1:{redis_port}",
                                      "held_out": None}, "endpoint"),
                "gen-000000000003": ({"prompts": str(good), "endpoint": f"http://injected:pw@{host}",
                                      "held_out": None}, "endpoint")}
    for job_id, (spec, _) in injected.items():
        jobs.put(JobRecord(id=job_id, stage="generate", spec=spec))
        dispatch("generate", job_id)
    ended = lambda j: j["state"] not in ("queued", "running")  # noqa: E731
    job = wait_for_job(lambda: clients["generate"].get(f"/v1/jobs/{control.json()['id']}").json(), ended)
    assert job["state"] == "succeeded", job
    assert job["progress"] == {"done": 1, "total": 1, "unit": "prompts"} and job["metrics"]["completed"] == 1
    for job_id, (_, field) in injected.items():
        job = wait_for_job(lambda job_id=job_id: clients["generate"].get(f"/v1/jobs/{job_id}").json(), ended)
        assert job["state"] == "failed" and job["error"].startswith(f"SpecError: {field}="), job
        assert "traceback" not in json.dumps(job) and "Traceback" not in job["error"]

    seen = b"\n".join(received)
    assert CONTROL.encode() in seen  # the allowed job's prompt got there
    assert MARKER.encode() not in seen and b"X-Injected" not in seen
    # what the APIs answered and recorded carries no credential
    records = json.dumps([clients[s].get("/v1/jobs", params={"limit": 1000}).json() for s in STAGE_ORDER])
    for secret_text in (S3_SECRET, API_KEY, "user:pass"):
        assert secret_text not in records
        assert not [a for a in answers if secret_text in a[3]], secret_text
    assert MARKER not in records

    print(f"\n{sum(statuses.values())} hostile requests, by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 120 and statuses[413] == 8 and not [s for s in statuses if s < 400 or s >= 500]

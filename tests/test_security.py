"""Security properties that hold for the whole code base: nothing unpickles (weights are safetensors, Celery
messages JSON), secrets never show in settings' text or in an API's access log, and object keys cannot leave their
prefix (test_store.py)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from eyas.settings import Settings
from orchestration.celery_app import make_celery
from orchestration.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("eyas", "services", "bench") for p in (REPO / d).rglob("*.py")]


def test_nothing_unpickles():
    unsafe = re.compile(r"\bpickle\.loads?\(|\btorch\.load\((?![^)]*weights_only=True)|\bdill\b|\bjoblib\.load\(")
    found = [f"{p.relative_to(REPO)}:{i}" for p in SOURCES
             for i, line in enumerate(p.read_text().splitlines(), 1) if unsafe.search(line)]
    assert SOURCES and not found, found


def test_task_messages_are_json_only():
    app = make_celery(Settings())
    assert app.conf.task_serializer == "json" and list(app.conf.accept_content) == ["json"]


def test_secrets_do_not_show_in_settings_text():
    s = ServiceSettings(s3_secret_key="s3-very-secret", api_key="api-very-secret")
    text = repr(s) + str(s) + s.model_dump_json()
    assert "s3-very-secret" not in text and "api-very-secret" not in text


def test_the_access_log_names_the_path_without_the_query(service_settings, api_process):
    """A client that sends a key as a query parameter (`?api_key=`) does not put it in the API's log: the real
    `eyas api` (uvicorn) logs each request's path and status, not its query string."""
    secret = "SECRET-in-a-query-4f1c"
    api = api_process("generate", service_settings)
    assert httpx.get(f"{api.url}/healthz", params={"api_key": secret}, timeout=10).status_code == 200
    r = httpx.get(f"{api.url}/v1/jobs", params={"api_key": secret, "state": "queued"}, timeout=10)
    assert r.status_code == 422  # an unknown query parameter, named to the caller who sent it
    deadline = time.monotonic() + 10
    while '"GET /v1/jobs HTTP/1.1" 422' not in api.tail(1 << 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = api.tail(1 << 20)
    assert secret not in log and "api_key" not in log, log[-2000:]
    assert '"GET /healthz HTTP/1.1" 200' in log and '"GET /v1/jobs HTTP/1.1" 422' in log, log[-2000:]

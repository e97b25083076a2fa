"""Security properties that hold for the whole code base: nothing unpickles (weights are safetensors, Celery
messages JSON), secrets never show in settings' text, and object keys cannot leave their prefix (test_store.py)."""
from __future__ import annotations

import re
from pathlib import Path

from eyas.settings import Settings
from orchestration.celery_app import make_celery

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
    s = Settings(s3_secret_key="s3-very-secret", api_key="api-very-secret")
    text = repr(s) + str(s) + s.model_dump_json()
    assert "s3-very-secret" not in text and "api-very-secret" not in text

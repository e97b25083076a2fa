"""The recording side of the pass-through: which requests are kept (on, sampled, under the rate bound, not opted
out), and how a window of them becomes one stored object of messages-JSONL, redacted, with older windows deleted.

The request path only draws a number and appends the raw bytes; parsing, redaction and the store write happen when
a window closes, in a thread, so recording adds no parsing or I/O to a forwarded request."""
from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from eyas.store import LocalStore, ObjectStore, S3Store
from orchestration.proxy.redact import make_redactor
from orchestration.proxy.settings import ProxySettings

STAMP = "%Y%m%dT%H%M%S"  # a window's start, UTC, in its object's name: retention reads it back
OPT_OUT_HEADER = b"x-eyas-no-record"  # a client that sends it (any value) is never recorded
ROLES = ("system", "user", "assistant")  # what the generator's messages-JSONL reader accepts


@dataclass
class Capture:
    """One sampled exchange as it passed: the request body and, when answers are recorded, the response chunks."""
    at: float
    request: bytes
    answer: list[bytes] | None


def traffic_store(settings) -> ObjectStore:
    """Where the windows go: the embedded workdir's store, or the service's bucket."""
    if settings.mode == "service":
        store = S3Store(settings)
        store.ensure_bucket()
        return store
    return LocalStore(settings.store_root)


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a list of content parts (images are not recorded)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        texts = [t for t in parts if isinstance(t, str)]
        return "\n".join(texts) if texts else None
    return None


def _answer(body: bytes) -> str | None:
    """The first choice's text of a chat completion, whole (JSON) or streamed (server-sent events)."""
    try:
        if not body.lstrip().startswith(b"data:"):
            return _text(json.loads(body)["choices"][0]["message"].get("content"))
        pieces = []
        for line in body.split(b"\n"):
            data = line[5:].strip() if line.startswith(b"data:") else b""
            if data and data != b"[DONE]":
                choices = json.loads(data).get("choices") or [{}]
                pieces.append(choices[0].get("delta", {}).get("content") or "")
        return "".join(pieces)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None  # an answer it cannot read (compressed, another shape) is left out, the request still kept


def to_record(request: dict, answer: str | None, redact: Callable[[str], str], rid: str, at: float) -> dict | None:
    """A chat request as one messages-JSONL record (None when it has no user text)."""
    messages = []
    for m in request.get("messages") or []:
        text = _text(m.get("content")) if isinstance(m, dict) else None
        if text is not None and m.get("role") in ROLES:
            messages.append({"role": m["role"], "content": redact(text)})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return None
    if answer:
        messages.append({"role": "assistant", "content": redact(answer)})
    return {"id": rid, "messages": messages, "model": request.get("model"),
            "time": datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")}


class Recorder:
    """Sampling, the rate bound and the window buffer live on the event loop's thread; `write` runs in another."""

    def __init__(self, store: ObjectStore, settings: ProxySettings, clock: Callable[[], float] = time.time):
        self.store, self.settings, self.clock = store, settings, clock
        self.enabled = settings.record
        self.redact = make_redactor(settings.redact_default, settings.redact_hook)
        self.instance = secrets.token_hex(4)  # replicas of the proxy never write the same object
        self._pending: list[Capture] = []
        self._minute, self._in_minute = -1, 0
        self._rng = random.Random()

    def sample(self, headers: Iterable[tuple[bytes, bytes]], size: int) -> bool:
        """Whether to record this chat request; counts it against the minute's rate bound when it does."""
        s = self.settings
        if not self.enabled or size > s.max_record_bytes or self._rng.random() >= s.sample:
            return False
        if any(k.lower() == OPT_OUT_HEADER for k, _ in headers):
            return False
        minute = int(self.clock() // 60)
        if minute != self._minute:
            self._minute, self._in_minute = minute, 0
        if self._in_minute >= s.max_records_per_minute:
            return False
        self._in_minute += 1
        return True

    def keep(self, capture: Capture) -> None:
        self._pending.append(capture)

    def pending(self) -> int:
        return len(self._pending)

    def take(self, final: bool = False) -> list[Capture]:
        """The captures of the windows that have closed (all of them when `final`), leaving the open window's."""
        if final:
            taken, self._pending = self._pending, []
            return taken
        open_start = self.clock() // self.settings.window_s * self.settings.window_s
        taken = [c for c in self._pending if c.at < open_start]
        self._pending = [c for c in self._pending if c.at >= open_start]
        return taken

    def write(self, captures: list[Capture]) -> list[str]:
        """Store each window of `captures` as one object, then delete the windows past retention; the keys written."""
        windows: dict[float, list[Capture]] = {}
        for c in captures:
            windows.setdefault(c.at // self.settings.window_s * self.settings.window_s, []).append(c)
        keys = []
        for start, group in sorted(windows.items()):
            stamp = datetime.fromtimestamp(start, UTC).strftime(STAMP)
            lines = self._lines(group, f"{stamp}-{self.instance}")
            if lines:
                keys.append(self.put_window(lines, stamp, self.instance))
        self.expire()
        return keys

    def _lines(self, group: list[Capture], name: str) -> list[str]:
        lines = []
        for i, c in enumerate(group):
            try:
                request = json.loads(c.request)
            except ValueError:
                continue
            if not isinstance(request, dict):
                continue
            answer = _answer(b"".join(c.answer)) if c.answer is not None else None
            record = to_record(request, answer, self.redact, f"{name}-{i}", c.at)
            if record is not None:
                lines.append(json.dumps(record, ensure_ascii=False))
        return lines

    def put_window(self, lines: list[str], stamp: str, source: str) -> str:
        key = f"{self.settings.prefix}/{stamp}-{source}.jsonl"
        self.store.put_bytes(key, ("\n".join(lines) + "\n").encode())
        return key

    def expire(self) -> list[str]:
        """Delete the stored windows that started before the retention bound; the keys deleted."""
        cutoff = datetime.fromtimestamp(self.clock(), UTC) - timedelta(hours=self.settings.retention_hours)
        gone = []
        for key in self.store.list(self.settings.prefix):  # the folder's keys: both stores list by folder
            name = key[len(self.settings.prefix) + 1:]
            try:
                start = datetime.strptime(name[:15], STAMP).replace(tzinfo=UTC)
            except ValueError:
                continue  # not a window this recorder wrote
            if start < cutoff:
                self.store.delete(key)
                gone.append(key)
        return gone


def import_requests(recorder: Recorder, lines: Iterable[str], source: str) -> tuple[str | None, int, int]:
    """Chat requests recorded elsewhere — one JSON object a line: a request body, or an OpenAI batch line whose
    `body` is one — stored as one window, redacted like recorded traffic: (key or None, kept, skipped)."""
    now = recorder.clock()
    stamp = datetime.fromtimestamp(now, UTC).strftime(STAMP)
    name = f"{stamp}-import-{secrets.token_hex(4)}"
    kept, skipped = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(request, dict) and isinstance(request.get("body"), dict):
            request = request["body"]
        record = to_record(request, None, recorder.redact, f"{name}-{i}", now) if isinstance(request, dict) else None
        if record is None:
            skipped += 1
        else:
            kept.append(json.dumps(record, ensure_ascii=False))
    key = recorder.put_window(kept, stamp, name[len(stamp) + 1:]) if kept else None
    return key, len(kept), skipped

"""The traffic pass-through (orchestration.proxy): what a client gets through it is what the endpoint sent, byte for
byte and streamed; what it records is a bounded, redacted sample the generator reads as prompts."""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from eyas.prompts import load_prompts
from eyas.settings import Settings
from eyas.store import LocalStore
from orchestration.cli import main
from orchestration.proxy.app import CONTROL_PATH, ProxyApp
from orchestration.proxy.recorder import Capture, Recorder, traffic_store
from orchestration.proxy.redact import mask_defaults
from orchestration.proxy.settings import ProxySettings
from tests.fake_llm import FakeLLM
from tests.servers import S3_ACCESS, S3_SECRET, free_port

CHAT = "/v1/chat/completions"
SECRET = "mail ada@example.org, key sk-proj-Abc123Def456Ghi789Jkl and card 4111 1111 1111 1111, meet at 10"


async def echo(scope, receive, send):
    """An upstream that answers with what it received: the forwarded request, to compare with the one sent."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    seen = {"method": scope["method"], "path": scope["raw_path"].decode(), "query": scope["query_string"].decode(),
            "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]], "body": body.decode()}
    out = json.dumps(seen).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


@contextlib.contextmanager
def serving(app, keep_alive_s: float = 5):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           server_header=False, date_header=False, timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def proxy(upstream: str, store_dir: Path, **settings):
    """A running pass-through; on leaving, it has stopped and stored what it sampled."""
    conf = ProxySettings(upstream=upstream, **{"record": True, "sample": 1.0, **settings})
    app = ProxyApp(conf, Recorder(LocalStore(store_dir), conf), api_key=settings.pop("api_key", None))
    with serving(app) as url:
        yield url, app


def recorded(store_dir: Path) -> list[dict]:
    store = LocalStore(store_dir)
    return [json.loads(line) for key in store.list("traffic") if key.endswith(".jsonl")
            for line in store.get_bytes(key).decode().splitlines()]


def chat(content: str, **extra) -> dict:
    return {"model": "target", "max_tokens": 16, "messages": [{"role": "user", "content": content}], **extra}


def same(raw: bytes) -> bytes:
    return re.sub(rb"fake-\d+", b"fake-N", raw)  # the fake endpoint numbers its answers


def test_responses_pass_through_byte_for_byte_streamed_or_not(tmp_path):
    with FakeLLM() as up, proxy(up, tmp_path) as (url, _), httpx.Client(timeout=30) as client:
        for path, body in ((CHAT, chat("hello")), ("/metrics", None), ("/v1/missing?x=1", None)):
            bare = client.request("POST" if body else "GET", up + path, json=body)
            through = client.request("POST" if body else "GET", url + path, json=body)
            assert (through.status_code, same(through.content)) == (bare.status_code, same(bare.content))
            assert through.headers.get("content-type") == bare.headers.get("content-type")
        chunks = {}
        for name, base in (("bare", up), ("through", url)):
            with client.stream("POST", base + CHAT, json=chat("stream it", stream=True)) as r:
                assert r.headers["content-type"] == "text/event-stream"
                chunks[name] = list(r.iter_raw())
        assert same(b"".join(chunks["through"])) == same(b"".join(chunks["bare"]))
        assert b"".join(chunks["through"]).endswith(b"data: [DONE]\n\n")
        assert len(chunks["through"]) > 1  # it came as a stream, not as one body at the end


def test_the_forwarded_request_is_the_one_sent_and_the_record_is_redacted(tmp_path):
    body = json.dumps(chat(SECRET)).encode()
    with serving(echo) as up, proxy(up, tmp_path) as (url, _):
        seen = httpx.post(url + CHAT + "?api-version=1", content=body,
                          headers={"authorization": "Bearer upstream-key", "x-custom": "kept"}).json()
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", CHAT, "api-version=1",
                                                                          body.decode())
    headers = dict(seen["headers"])
    assert headers["authorization"] == "Bearer upstream-key" and headers["x-custom"] == "kept"
    [record] = recorded(tmp_path)
    text = record["messages"][0]["content"]
    assert text == "mail [email], key [key] and card [number], meet at 10"


def test_default_masks_and_the_operators_hook(tmp_path):
    assert mask_defaults("write to bob.smith+x@mail.co.uk") == "write to [email]"
    assert mask_defaults("token 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08.") == "token [key]."
    assert mask_defaults("call +1 555-123-4567 now") == "call +[number] now"
    assert mask_defaults("a path /usr/lib/python3.11/site-packages/x and 2024") == (
        "a path /usr/lib/python3.11/site-packages/x and 2024")
    with serving(echo) as up, proxy(up, tmp_path, redact_hook="html:escape") as (url, _):
        httpx.post(url + CHAT, json=chat("<b>id 1234567</b>"))
    assert recorded(tmp_path)[0]["messages"][0]["content"] == "&lt;b&gt;id [number]&lt;/b&gt;"


def test_sampling_none_or_all_and_answers_only_when_allowed(tmp_path):
    with FakeLLM() as up:
        with proxy(up, tmp_path / "none", sample=0.0) as (url, _):
            for i in range(5):
                httpx.post(url + CHAT, json=chat(f"question {i}"))
        assert recorded(tmp_path / "none") == []
        answers = []
        with proxy(up, tmp_path / "all", record_answers=True) as (url, _):
            for i in range(5):
                r = httpx.post(url + CHAT, json=chat(f"question {i}"))
                answers.append(r.json()["choices"][0]["message"]["content"])
            with httpx.stream("POST", url + CHAT, json=chat("streamed", stream=True)) as r:
                streamed = "".join(json.loads(line[5:])["choices"][0]["delta"].get("content", "")
                                   for line in r.iter_lines() if line.startswith("data: {"))
            httpx.get(url + "/metrics")  # not a chat request: never recorded
        with proxy(up, tmp_path / "prompts-only") as (url, _):
            httpx.post(url + CHAT, json=chat("no answer kept"))
    records = sorted(recorded(tmp_path / "all"), key=lambda r: r["messages"][0]["content"])
    assert [r["messages"] for r in records] == [
        [{"role": "user", "content": "question 0"}, {"role": "assistant", "content": answers[0]}],
        *[[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answers[i]}]
          for i in range(1, 5)],
        [{"role": "user", "content": "streamed"}, {"role": "assistant", "content": streamed}]]
    assert recorded(tmp_path / "prompts-only")[0]["messages"] == [{"role": "user", "content": "no answer kept"}]
    windows = (tmp_path / "all" / "traffic").iterdir()  # two when the test ran across a minute's turn
    assert sorted(p.user_turns[0] for w in windows for p in load_prompts(w)) == sorted(
        [f"question {i}" for i in range(5)] + ["streamed"])  # what the generator reads as prompts


def test_rate_bound_off_switch_and_opt_out(tmp_path):
    with FakeLLM() as up, proxy(up, tmp_path, max_records_per_minute=3, api_key="op-key") as (url, _):
        for i in range(6):
            httpx.post(url + CHAT, json=chat(f"rated {i}"))
        assert httpx.post(url + CONTROL_PATH, json={"enabled": False}).status_code == 401
        auth = {"authorization": "Bearer op-key"}
        state = httpx.post(url + CONTROL_PATH, json={"enabled": False}, headers=auth).json()
        assert (state["enabled"], state["pending"]) == (False, 3)
    assert sorted(r["messages"][0]["content"] for r in recorded(tmp_path)) == ["rated 0", "rated 1", "rated 2"]
    with FakeLLM() as up, proxy(up, tmp_path / "switch") as (url, _):
        httpx.post(url + CONTROL_PATH, json={"enabled": False})
        assert httpx.post(url + CHAT, json=chat("while off")).status_code == 200
        assert httpx.post(url + CONTROL_PATH, json={"enabled": "no"}).status_code == 422
        httpx.post(url + CONTROL_PATH, json={"enabled": True})
        httpx.post(url + CHAT, json=chat("while on"))
        httpx.post(url + CHAT, json=chat("opted out"), headers={"x-eyas-no-record": "1"})
    assert [r["messages"][0]["content"] for r in recorded(tmp_path / "switch")] == ["while on"]
    with FakeLLM() as up, proxy(up, tmp_path / "off", record=False) as (url, _):
        httpx.post(url + CHAT, json=chat("never"))
    assert recorded(tmp_path / "off") == []


def test_windows_are_objects_of_their_own_and_retention_deletes_old_ones(tmp_path):
    t0 = 1_800_000_000.0  # a minute's start
    now = [t0]
    store = LocalStore(tmp_path)
    rec = Recorder(store, ProxySettings(record=True, sample=1.0, window_s=60, retention_hours=1),
                   clock=lambda: now[0])
    store.put_bytes("traffic/notes.txt", b"not a window")
    for t, when in ((t0, "first"), (t0 + 30, "still first"), (t0 + 61, "second")):
        rec.keep(Capture(t, json.dumps(chat(when)).encode(), None))
    now[0] = t0 + 90
    first = rec.write(rec.take())  # the window still open (from +60) waits
    assert len(first) == 1 and rec.pending() == 1
    assert len(recorded(tmp_path)) == 2
    now[0] = t0 + 3630  # an hour after the first window's start, not yet after the second's
    second = rec.write(rec.take())
    assert len(second) == 1 and second != first
    assert store.list("traffic") == sorted(second + ["traffic/notes.txt"])  # the first window expired
    assert [r["messages"][0]["content"] for r in recorded(tmp_path)] == ["second"]


def test_windows_in_s3_expire_and_leave_the_neighbours_alone(s3_endpoint, tmp_path):
    settings = Settings(mode="service", s3_endpoint=s3_endpoint, s3_access_key=S3_ACCESS, s3_secret_key=S3_SECRET,
                        s3_bucket=f"eyas-proxy-{time.time_ns()}", workdir=tmp_path)
    store = traffic_store(settings)  # the bucket is made if missing
    now = [1_800_000_000.0]
    rec = Recorder(store, ProxySettings(record=True, window_s=60, retention_hours=1), clock=lambda: now[0])
    store.put_bytes("traffic-old/20200101T000000-x.jsonl", b"{}")  # shares the prefix's letters, not its folder
    rec.keep(Capture(now[0], json.dumps(chat("old")).encode(), None))
    [old] = rec.write(rec.take(final=True))
    now[0] += 7200
    rec.keep(Capture(now[0], json.dumps(chat("new")).encode(), None))
    [new] = rec.write(rec.take(final=True))
    assert store.list("traffic") == [new] and old != new
    assert store.exists("traffic-old/20200101T000000-x.jsonl")
    assert json.loads(store.get_bytes(new))["messages"] == [{"role": "user", "content": "new"}]
    store.delete_prefix("")
    store.client.remove_bucket(settings.s3_bucket)


def test_a_client_that_hangs_up_ends_the_upstream_request(tmp_path):
    fake = FakeLLM(slots=4, token_s=0.5)  # every answer takes seconds
    with fake as up, proxy(up, tmp_path) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + CHAT, json=chat("slow"), timeout=0.5)
        deadline = time.monotonic() + 5
        while fake.stats["aborted"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert fake.stats["aborted"] == 1 and recorded(tmp_path) == []


def test_a_kept_alive_connection_the_upstream_closed_is_replaced(tmp_path):
    with serving(echo, keep_alive_s=0.2) as up, proxy(up, tmp_path) as (url, _), httpx.Client() as client:
        first = client.post(url + CHAT, json=chat("first"))
        time.sleep(0.6)  # the upstream has closed the idle connection the proxy keeps
        second = client.post(url + CHAT, json=chat("second"))
    assert (first.status_code, second.status_code) == (200, 200)
    assert json.loads(second.json()["body"])["messages"][0]["content"] == "second"


def test_an_unreachable_upstream_is_a_502_that_names_it(tmp_path):
    gone = f"http://127.0.0.1:{free_port()}"
    with proxy(gone, tmp_path) as (url, _):
        r = httpx.post(url + CHAT, json=chat("anyone there?"))
    assert r.status_code == 502 and gone in r.json()["error"] and recorded(tmp_path) == []


def test_import_a_jsonl_of_requests(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("EYAS_MODE", raising=False)
    file = tmp_path / "requests.jsonl"
    file.write_text("\n".join([json.dumps(chat("plain body, call 0612345678")),
                               json.dumps({"custom_id": "b1", "method": "POST", "url": CHAT,
                                           "body": chat("a batch line")}),
                               json.dumps({"prompt": "a completion, not a chat"}), "not json", ""]))
    assert main(["traffic", "import", str(file), "--workdir", str(tmp_path / "work")]) == 0
    assert "imported 2 requests (2 skipped" in capsys.readouterr().out
    [window] = (Settings(workdir=tmp_path / "work").store_root / "traffic").iterdir()
    assert [p.user_turns for p in load_prompts(window)] == [["plain body, call [number]"], ["a batch line"]]

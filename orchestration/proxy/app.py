"""The pass-through as a plain ASGI app (no framework between the two sockets: every microsecond is paid on every
request): the method, path, query, headers (less hop-by-hop ones) and body go upstream unchanged, and the response
comes back chunk by chunk as the upstream sends it, streamed answers included. One path is its own:
/_eyas/recording, the recording's state (GET) and off switch (POST {"enabled": bool})."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from eyas.settings import Settings
from orchestration.proxy.recorder import Capture, Recorder, traffic_store
from orchestration.proxy.settings import ProxySettings
from orchestration.proxy.upstream import Upstream, UpstreamError
from orchestration.settings import ServiceSettings

log = logging.getLogger(__name__)
CONTROL_PATH = "/_eyas/recording"
# RFC 9110 §7.6.1 connection-specific fields: each side of the proxy sets its own
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade"})
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length"}  # the client to the upstream sets them for its request


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _reply(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class ProxyApp:
    def __init__(self, settings: ProxySettings, recorder: Recorder, api_key: str | None = None):
        self.settings, self.recorder, self.api_key = settings, recorder, api_key
        self.upstream = Upstream(settings.upstream, settings.upstream_timeout_s)
        self._flusher: asyncio.Task | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["path"] == CONTROL_PATH:
                await self._control(scope, receive, send)
            else:
                await self._forward(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._flusher = asyncio.create_task(self._flush_windows())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._flusher
                await self.flush(final=True)  # the open window is stored too: nothing sampled is lost on a stop
                self.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def flush(self, final: bool = False) -> list[str]:
        captures = self.recorder.take(final)
        try:
            return await asyncio.to_thread(self.recorder.write, captures)
        except Exception:  # a store outage costs this window's records, never the forwarding
            log.exception("storing %d recorded requests failed; they are dropped", len(captures))
            return []

    async def _flush_windows(self) -> None:
        window = self.settings.window_s
        while True:
            await asyncio.sleep(window - self.recorder.clock() % window + 0.05)
            await self.flush()

    async def _forward(self, scope, receive, send) -> None:
        body = await _body(receive)
        target = (scope.get("raw_path") or scope["path"].encode()) + (
            b"?" + scope["query_string"] if scope["query_string"] else b"")
        headers = [(k, v) for k, v in scope["headers"] if k not in NOT_FORWARDED]
        sampled = (scope["method"] == "POST" and scope["path"].endswith("/chat/completions")
                   and self.recorder.sample(scope["headers"], len(body)))
        relay = asyncio.ensure_future(self._relay(scope["method"].encode(), target, headers, body, send, sampled))
        # a client that hangs up ends the upstream request too (vLLM then aborts the generation)
        hangup = asyncio.ensure_future(receive())
        await asyncio.wait({relay, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if not relay.done():
            relay.cancel()
        hangup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay

    async def _relay(self, method: bytes, target: bytes, headers: list, body: bytes, send, sampled: bool) -> None:
        try:
            response = await self.upstream.request(method, target, headers, body)
        except UpstreamError as e:
            await _reply(send, 502, {"error": f"upstream {self.settings.upstream} unreachable: {e}"})
            return
        chunks = [] if sampled and self.settings.record_answers else None
        # closed on every way out: a cancelled relay (the client hung up) closes the upstream connection
        async with contextlib.aclosing(response.body()) as answer:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP]})
            async for chunk in answer:
                if chunks is not None:
                    chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        if sampled and 200 <= response.status < 300:
            self.recorder.keep(Capture(self.recorder.clock(), body, chunks))

    async def _control(self, scope, receive, send) -> None:
        if self.api_key is not None:
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}"):
                await _reply(send, 401, {"error": "a bearer key is required (EYAS_API_KEY)"})
                return
        if scope["method"] == "POST":
            try:
                enabled = json.loads(await _body(receive))["enabled"]
            except (ValueError, KeyError, TypeError):
                enabled = None
            if not isinstance(enabled, bool):
                await _reply(send, 422, {"error": 'body must be {"enabled": true|false}'})
                return
            self.recorder.enabled = enabled
        s = self.settings
        await _reply(send, 200, {"enabled": self.recorder.enabled, "sample": s.sample,
                                 "record_answers": s.record_answers, "pending": self.recorder.pending(),
                                 "window_s": s.window_s, "retention_hours": s.retention_hours,
                                 "max_records_per_minute": s.max_records_per_minute})


def build_app(proxy: ProxySettings, settings: Settings) -> ProxyApp:
    settings = ServiceSettings.of(settings)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    return ProxyApp(proxy, Recorder(traffic_store(settings), proxy), api_key=key)


def serve_proxy(proxy: ProxySettings, settings: Settings) -> None:
    import uvicorn

    log.info("forwarding %s:%d → %s; recording %s (sample %.3g, answers %s)", proxy.host, proxy.port,
             proxy.upstream, "on" if proxy.record else "off", proxy.sample, proxy.record_answers)
    uvicorn.run(build_app(proxy, settings), host=proxy.host, port=proxy.port, log_level="warning",
                access_log=False, lifespan="on", server_header=False, date_header=False)  # the upstream's own

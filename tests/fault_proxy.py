"""A fault-injecting HTTP proxy for tests: it sits in front of a real OpenAI-compatible endpoint and, at set
rates, hangs past the client's timeout (then drops the connection, never answering), answers 429 with Retry-After,
500 or 503, resets the connection, or truncates the response body; optionally adds a fixed latency to every request.
It also measures how many completions are in flight at the endpoint at once, and when each ended (other requests,
such as the throttle's reads of /metrics, pass through uncounted).

Runs its own event loop in a thread; `with FaultProxy(upstream, rates) as url:`.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

FAULTS = ("delay", "429", "500", "503", "reset", "truncate")


@dataclass
class FaultProxy:
    upstream: str
    rates: dict[str, float] = field(default_factory=dict)  # fault → probability per request
    delay_s: float = 5.0  # for "delay": how long the request hangs before its connection drops (past the timeout)
    retry_after: str = "1"  # the 429's Retry-After, in seconds
    latency_s: float = 0.0  # added to every forwarded request: an endpoint whose capacity outruns its latency
    cycle: int = 25  # faults are spread evenly: in every `cycle` requests a fault of rate r occurs r·cycle times
    counts: Counter = field(default_factory=Counter)  # injected faults and forwarded requests
    max_in_flight: int = 0  # at the upstream
    in_flight: int = 0
    completed_at: list[float] = field(default_factory=list)  # monotonic end time of each forwarded completion

    def __post_init__(self):
        unknown = set(self.rates) - set(FAULTS)
        assert not unknown, f"unknown faults {unknown}"
        self._next = 0
        self._lock = threading.Lock()

    def _pick(self) -> str | None:
        with self._lock:  # a stride coprime with the cycle visits every slot once per cycle, well mixed
            slot = self._next * 7 % self.cycle
            self._next += 1
        taken = 0
        for fault, p in self.rates.items():
            taken += round(p * self.cycle)
            if slot < taken:
                return fault
        return None

    async def _read_request(self, reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return method, path, headers, body

    @staticmethod
    def _response(status: int, body: bytes, extra: dict[str, str] | None = None, length: int | None = None) -> bytes:
        reason = {200: "OK", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}
        hdrs = {"content-type": "application/json", "content-length": str(len(body) if length is None else length),
                "connection": "keep-alive", **(extra or {})}
        head = f"HTTP/1.1 {status} {reason.get(status, 'X')}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
        return head.encode() + b"\r\n" + body

    async def _handle(self, reader, writer):
        try:
            while True:
                try:
                    req = await self._read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, path, headers, body = req
                fault = self._pick() if path.endswith("/completions") else None
                if fault:
                    self.counts[fault] += 1
                if fault == "reset":
                    writer.transport.abort()
                    return
                if fault in ("429", "500", "503"):
                    extra = {"retry-after": self.retry_after} if fault == "429" else {}
                    writer.write(self._response(int(fault), b'{"error": "injected"}', extra))
                    await writer.drain()
                    continue
                if fault == "delay":  # a hung server: the endpoint never sees the request, so no work is wasted there
                    await asyncio.sleep(self.delay_s)
                    writer.transport.abort()
                    return
                completion = path.endswith("/completions")
                self.in_flight += completion
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    await asyncio.sleep(self.latency_s if completion else 0.0)
                    resp = await self._client.request(method, self.upstream + path, content=body,
                                                      headers={"content-type": headers.get("content-type", "")})
                finally:
                    self.in_flight -= completion
                if completion:
                    self.counts["forwarded"] += 1
                    self.completed_at.append(time.monotonic())
                if fault == "truncate":
                    writer.write(self._response(resp.status_code, resp.content[: len(resp.content) // 2],
                                                length=len(resp.content)))
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(self._response(resp.status_code, resp.content))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    def __enter__(self) -> str:
        ready = threading.Event()

        def serve():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def start():
                # no connection cap: the proxy must not be what limits concurrency at the endpoint
                self._client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None,
                                                                                  max_keepalive_connections=None))
                self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()

            self._loop.run_until_complete(start())
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        async def stop():
            self._server.close()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in handlers:  # connections still open (keep-alive clients): end them, awaited
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            await self._client.aclose()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

"""A fake OpenAI-compatible LLM server that behaves like one under load (vLLM's continuous batching), for the
generator's tests and benchmark: a fixed number of batch slots; a time per output token that grows with the batch;
a first-come-first-served waiting queue beyond the slots; generation lengths that vary widely from prompt to prompt
(long-tailed, a few hit max_tokens) but are the same for a prompt on every run; optionally 429 once the queue is
full; vLLM's scheduler gauges on /metrics (or none, like a server that publishes no load); a request whose client
hangs up leaves the batch (vLLM aborts it).

Time is a fluid: every running request advances at 1 / step_s(batch) tokens per second, so a request's latency is its
length times the per-token times it saw, plus its wait in the queue. The server also measures what a benchmark
needs: GET /stats (first request, last answer, answers, the batch over time), POST /stats/reset.

    with FakeLLM(slots=64) as url: ...                   # in a thread of this process (tests)
    FakeLLM(slots=256).serve_forever(port)               # blocking (a process of its own, for the benchmark)
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import math
import random
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass


@dataclass
class FakeLLM:
    slots: int = 64  # requests decoded together (vLLM's max_num_seqs)
    token_s: float = 0.002  # time per output token with one request running
    full_batch_slowdown: float = 3.0  # time per token with every slot busy, relative to one request alone
    median_fraction: float = 0.3  # median generation length as a fraction of the request's max_tokens
    max_waiting: int | None = None  # a request arriving to this many waiting gets 429 (None: the queue is unbounded)
    metrics: bool = True  # publish vLLM's gauges on /metrics (False: 404, like a server that publishes no load)
    trace_every_s: float = 0.02  # resolution of the batch-over-time trace in /stats

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.stats = {"first_request": None, "last_answer": None, "answers": 0, "tokens": 0, "rejected": 0,
                      "aborted": 0, "trace": []}

    def step_s(self, batch: int) -> float:
        """Seconds per decode step (one token for every running request) with `batch` requests running."""
        busy = (max(batch, 1) - 1) / max(self.slots - 1, 1)
        return self.token_s * (1 + (self.full_batch_slowdown - 1) * busy)

    def length(self, text: str, max_tokens: int) -> int:
        """A prompt's generation length: log-normal around median_fraction × max_tokens, fixed by the prompt."""
        rng = random.Random(zlib.crc32(text.encode()))
        return max(1, min(max_tokens, round(max_tokens * rng.lognormvariate(math.log(self.median_fraction), 0.8))))

    # ------------------------------------------------------------------ the batch (fluid time)

    def _start_batch(self) -> None:
        self.clock = 0.0  # tokens each running request has generated since the server started
        self._at = time.monotonic()
        self.running: dict[int, asyncio.Future] = {}
        self._finish: list[tuple[float, int]] = []  # (clock at which it is done, id); ids no longer running are stale
        self.waiting: deque[tuple[int, int, asyncio.Future]] = deque()
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._last_trace = 0.0

    def _advance(self) -> None:
        now = time.monotonic()
        if self.running:
            self.clock += (now - self._at) / self.step_s(len(self.running))
        self._at = now
        if now - self._last_trace >= self.trace_every_s:
            self._last_trace = now
            self.stats["trace"].append((now, len(self.running), len(self.waiting)))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.slots:
            rid, tokens, fut = self.waiting.popleft()
            if not fut.done():
                self.running[rid] = fut
                heapq.heappush(self._finish, (self.clock + tokens, rid))

    def _submit(self, tokens: int) -> tuple[int, asyncio.Future]:
        self._advance()
        rid, fut = next(self._ids), asyncio.get_running_loop().create_future()
        self.waiting.append((rid, tokens, fut))
        self._admit()
        self._wake.set()
        return rid, fut

    def _abort(self, rid: int, fut: asyncio.Future) -> None:
        self._advance()
        fut.cancel()  # a waiting one is skipped at admission
        if self.running.pop(rid, None) is not None:
            self._admit()
        self.stats["aborted"] += 1
        self._wake.set()

    async def _decode(self) -> None:
        while True:
            self._advance()
            while self._finish and (self._finish[0][1] not in self.running  # stale: aborted
                                    or self._finish[0][0] <= self.clock + 1e-9):
                _, rid = heapq.heappop(self._finish)
                fut = self.running.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            self._admit()
            self._wake.clear()
            timeout = (self._finish[0][0] - self.clock) * self.step_s(len(self.running)) if self._finish else None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ HTTP

    def _metrics_text(self) -> bytes:
        label = '{engine="0",model_name="target"}'
        return (f"vllm:num_requests_running{label} {len(self.running)}\n"
                f"vllm:num_requests_waiting{label} {sum(not f.done() for _, _, f in self.waiting)}\n"
                f"vllm:kv_cache_usage_perc{label} {len(self.running) / self.slots}\n").encode()

    async def _chat(self, body: bytes, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        now = time.monotonic()
        if self.stats["first_request"] is None:
            self.stats["first_request"] = now
        req = json.loads(body)
        text = json.dumps(req.get("messages") or req.get("prompt"))
        tokens = self.length(text, int(req.get("max_tokens") or 16))
        if self.max_waiting is not None and len(self.running) >= self.slots and len(self.waiting) >= self.max_waiting:
            self.stats["rejected"] += 1
            return 429, b'{"error": "too many requests waiting"}'
        rid, fut = self._submit(tokens)
        hangup = asyncio.ensure_future(reader.read(1))  # a client that gives up closes the connection
        await asyncio.wait({fut, hangup}, return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            self._abort(rid, fut)
            raise ConnectionError("client hung up")
        hangup.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # the connection's next request is read after this
            await hangup
        self.stats["answers"] += 1
        self.stats["tokens"] += tokens
        self.stats["last_answer"] = time.monotonic()
        finish = "length" if tokens == int(req.get("max_tokens") or 16) else "stop"
        if req.get("stream"):
            return 200, self._sse(f"fake-{rid}", req.get("model", "target"), tokens, finish)
        return 200, json.dumps({
            "id": f"fake-{rid}", "object": "chat.completion", "model": req.get("model", "target"),
            "choices": [{"index": 0, "finish_reason": finish,
                         "message": {"role": "assistant", "content": f"An answer of {tokens} tokens."}}],
            "usage": {"prompt_tokens": len(text) // 4, "completion_tokens": tokens,
                      "total_tokens": len(text) // 4 + tokens}}).encode()

    @staticmethod
    def _sse(rid: str, model: str, tokens: int, finish: str) -> list[bytes]:
        """A streamed answer as vLLM sends it: one server-sent event per token, then [DONE]; each its own chunk."""
        def event(delta: dict, reason: str | None) -> bytes:
            chunk = {"id": rid, "object": "chat.completion.chunk", "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        words = [f"An answer of {tokens} tokens."] + [f" t{i}" for i in range(1, tokens)]
        return ([event({"role": "assistant", "content": ""}, None)] + [event({"content": w}, None) for w in words]
                + [event({}, finish), b"data: [DONE]\n\n"])

    async def _route(self, method: str, path: str, body: bytes, reader) -> tuple[int, bytes | list[bytes]]:
        if method == "POST" and path.endswith("/chat/completions"):
            return await self._chat(body, reader)
        if method == "GET" and path == "/metrics" and self.metrics:
            return 200, self._metrics_text()
        if method == "GET" and path == "/stats":
            return 200, json.dumps(self.stats).encode()
        if method == "POST" and path == "/stats/reset":
            self.reset()
            return 200, b"{}"
        return 404, b'{"error": "not found"}'

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reasons = {200: "OK", 404: "Not Found", 429: "Too Many Requests"}
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next((int(ln.split(":", 1)[1]) for ln in lines[1:]
                               if ln.lower().startswith("content-length:")), 0)
                status, out = await self._route(method, path, await reader.readexactly(length), reader)
                extra = "retry-after: 1\r\n" if status == 429 else ""
                if isinstance(out, list):  # a stream: chunked transfer encoding, one event per chunk
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    for event in out:
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                    continue
                writer.write(f"HTTP/1.1 {status} {reasons[status]}\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(out)}\r\n{extra}\r\n".encode() + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, port: int, started: threading.Event | None = None) -> None:
        self._start_batch()
        decoder = asyncio.ensure_future(self._decode())
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        if started is not None:
            started.set()
        try:
            await self._server.serve_forever()
        finally:
            decoder.cancel()

    def serve_forever(self, port: int) -> None:
        asyncio.run(self._serve(port))

    def __enter__(self) -> str:
        started = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            self._task = self._loop.create_task(self._serve(0, started))
            try:
                self._loop.run_until_complete(self._task)
            except asyncio.CancelledError:
                pass

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(10), "the fake LLM server did not start"
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        async def stop():
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._thread.join(10)

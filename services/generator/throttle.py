"""Adaptive concurrency against one endpoint, as TCP does it: slow start, then AIMD, within a maximum.

Slow start: every answer adds a slot, so the limit doubles each round trip and goes from the initial limit to the
maximum in log2(maximum / initial) round trips, unless congestion ends it first; it starts at half the maximum
(initial_limit), so that is one round trip. Then AIMD: every answer adds
1/limit (a slot per round trip) and congestion multiplies the limit by DECREASE.

Congestion is any of:
- the server's queue, where it publishes one (server_load.py: vLLM, SGLang, TGI): more requests waiting than a
  small share of those running. The cut is by what waits (never below × DECREASE), so the server's slots stay full
  with no queue behind them; and while nothing waits, slow start keeps the limit at least twice what is in flight,
  so with 30–60 s generations the server is at full batch within seconds, not after several round trips.
- latency, where the server publishes no queue: the time per output token of recent answers (their summed latency
  over their summed output tokens, so a short answer's wait in a queue weighs no more than a long one's) over
  `latency_factor` times the fastest seen. A factor well above one, because a full batch is slower per token than
  an empty one (about 2–4× on GPUs), and a queue slower still.
- errors: more than half of the recent answers were retryable errors (429, 5xx, timeouts, resets). A trickle of
  faults is noise, retried with backoff: AIMD that cuts on every fault sinks to one request in flight under a 20 %
  fault rate. A flood is overload.
One cut per round trip: a signal from a request sent before the last cut is about the old limit (TCP ignores
losses from before its last cut for the same reason); a cut from the server's queue waits until what is in flight
has come down to the cut limit.

The state (limit, slow-start threshold, last cut, requests in flight) is the endpoint's, kept by a Limit
(eyas.coordination) that the deployment provides: this process's own, or one every generator worker shares.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import httpx

from eyas.coordination import Limit
from services.generator.server_load import Load, ServerLoad

log = logging.getLogger(__name__)

DECREASE = 0.7  # CUBIC's: a batching server at 70 % of its batch loses far less than 30 % of its throughput
ERROR_SHARE = 0.5  # of recent answers: above it, errors are overload, not noise
QUEUE_SHARE = 1 / 16  # of the requests running: more waiting than this is a queue, not arrivals between steps
RECENT = 32  # answers that make up "recent" (the EWMAs' span)
POLL_S = 0.5  # how often the server's load is read


class Signals:
    """What the answers say about the endpoint's load: pure bookkeeping, no I/O."""

    def __init__(self, latency_factor: float):
        self.latency_factor = latency_factor  # 0: latency is no signal
        self.fastest = math.inf  # seconds per output token
        self.answers = 0
        self.latency_s = self.tokens = 0.0  # recent answers' mean latency and output tokens (EWMAs)
        self.errors = 0.0  # recent share of answers that were errors (EWMA)
        self.server_reports = False  # the server publishes its queue: that, not latency, says when it is full

    def answered(self, latency_s: float, tokens: int) -> bool:
        """An answer; True when its latency says the endpoint is congested."""
        self.errors -= self.errors / RECENT
        self.answers += 1
        weight = max(1 / self.answers, 1 / RECENT)  # a plain mean until there are RECENT answers
        self.latency_s += (latency_s - self.latency_s) * weight
        self.tokens += (max(tokens, 1) - self.tokens) * weight
        if self.answers < RECENT // 2:  # too few to say what is fast
            return False
        per_token = self.latency_s / self.tokens
        self.fastest = min(self.fastest, per_token)
        return self.latency_factor > 0 and not self.server_reports and per_token > self.latency_factor * self.fastest

    def failed(self) -> bool:
        """A retryable error; True when errors are this common."""
        self.errors += (1 - self.errors) / RECENT
        return self.errors > ERROR_SHARE


def initial_limit(maximum: int) -> int:
    """Where slow start begins by default: half the job's concurrency (at least 4), so that while latency stays
    flat the limit reaches it in one round trip, whatever the concurrency, where starting at 4 took
    log2(concurrency / 4) (8 round trips at 1,000). From a quarter, short runs against an endpoint without
    /metrics fell behind a bare client fixed at the job's concurrency (bench/README.md § Measured defaults).
    Tripling per round trip from half reached it sooner, but against a 16-slot server without /metrics it
    overshot past what latency steering pulled back within 600 requests (tests/test_throttle.py)."""
    return min(maximum, max(4, -(-maximum // 2)))


def increase(limit: float, ssthresh: float) -> float:
    """What one answer adds to the limit: a slot in slow start (×2 per round trip), else 1/limit (+1)."""
    return 1.0 if limit < ssthresh else 1.0 / limit


class Throttle:
    """`async with throttle.slot() as sent:` around each request; then `success(sent, latency_s, tokens)`, or
    `failure(sent)` after a retryable error. `most`: the most requests this process keeps in flight."""

    def __init__(self, limit: Limit, most: int, latency_factor: float = 0.0, load: ServerLoad | None = None):
        self.limit, self.most, self.load = limit, most, load
        self.signals = Signals(latency_factor)
        self.in_flight = 0
        # this process's own cap: a shared limit's maximum is the job's, across every worker
        self._own = asyncio.Semaphore(most)
        self._watcher: asyncio.Task | None = None
        self._closed = False

    @contextlib.asynccontextmanager
    async def slot(self, first: bool = False):
        """A slot under the limit, for one request; `first`: ahead of the requests waiting (a retry)."""
        if self.load is not None and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch())
        async with self._own:  # first this process's room, so no shared slot is held while waiting for it
            token = await self.limit.acquire(first)
            self.in_flight += 1
            try:
                yield time.time()
            finally:
                self.in_flight -= 1
                await self.limit.release(token)

    async def success(self, sent: float, latency_s: float, tokens: int) -> None:
        if self.signals.answered(latency_s, tokens):
            await self._cut(sent, "latency")
        elif self.limit.limit < self.limit.maximum:
            await self.limit.grow(increase(self.limit.limit, self.limit.ssthresh))

    async def failure(self, sent: float) -> None:
        if self.signals.failed():
            await self._cut(sent, "errors")

    async def _cut(self, sent: float, why: str, by: float = math.inf) -> None:
        before = self.limit.limit
        await self.limit.cut(sent, DECREASE, by)
        if self.limit.limit < before:
            log.info("endpoint congested (%s): limit %.0f → %.0f", why, before, self.limit.limit)

    async def _watch(self) -> None:
        """Steer by the server's own queue for as long as it publishes one (and the throttle is open)."""
        while not self._closed:
            try:
                load = await self.load.read()
            except httpx.HTTPError as e:  # unreachable for now: the requests' retries deal with that
                log.debug("server load unreadable: %s", e)
            else:
                if load is None:
                    log.info("%s publishes no queue: latency steers the throttle", self.load.url)
                    self.signals.server_reports = False
                    return
                self.signals.server_reports = True
                await self._steer(load)
            await asyncio.sleep(POLL_S)

    async def _steer(self, load: Load) -> None:
        in_flight = await self.limit.in_flight()
        if load.waiting > max(1.0, load.running * QUEUE_SHARE):
            if in_flight <= self.limit.limit:  # an earlier cut has taken effect: what waits now is too many
                await self._cut(time.time(), "server queue", by=load.waiting)
        elif load.waiting == 0 and self.limit.limit < self.limit.ssthresh:
            await self.limit.at_least(2 * in_flight)

    async def aclose(self) -> None:
        if self._watcher is not None:
            # The flag too: a cancel that lands inside httpx's own timeout scope (anyio) can be swallowed, and a
            # watcher that went on polling would keep this await, and the job, waiting for ever.
            self._closed = True
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.load is not None:
            await self.load.aclose()
        await self.limit.aclose()

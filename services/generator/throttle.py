"""Adaptive concurrency against an endpoint: AIMD within a maximum that all generator workers share.

AIMD: start low; each success with healthy latency adds 1/limit (≈ +1 per round trip of requests); a 429, 5xx
or timeout halves the limit (at most once per cool-down, so one burst of errors is one signal).
Global maximum: in service mode every worker process, on any machine, takes a lease in one Redis sorted set per
endpoint before each request; leases expire, so a killed worker cannot hold slots forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from dataclasses import dataclass


@dataclass
class AimdState:
    limit: float
    maximum: int
    minimum: int = 1
    cooldown_s: float = 2.0
    slow_latency_s: float | None = None  # latencies above this count as congestion
    _last_cut: float = 0.0

    def on_success(self, latency_s: float) -> None:
        if self.slow_latency_s is not None and latency_s > self.slow_latency_s:
            self.on_congestion()
        else:
            self.limit = min(float(self.maximum), self.limit + 1.0 / max(self.limit, 1.0))

    def on_congestion(self) -> None:
        now = time.monotonic()
        if now - self._last_cut >= self.cooldown_s:
            self.limit = max(float(self.minimum), self.limit / 2)
            self._last_cut = now


# KEYS[1] = lease set; ARGV = now, expiry, max, token. Drop expired leases, then take one if under max.
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
  return 1
end
return 0
"""


class GlobalLeases:
    """A counting semaphore in Redis shared by every worker talking to one endpoint. Leases are short and renewed
    while their request runs, so a killed worker's slots come back within `lease_s`."""

    def __init__(self, redis_url: str, endpoint: str, maximum: int, lease_s: float = 15.0):
        import redis.asyncio as aioredis

        self.r = aioredis.Redis.from_url(redis_url)
        self.key = "eyas:endpoint-leases:" + hashlib.sha1(endpoint.encode()).hexdigest()[:16]
        self.maximum, self.lease_s = maximum, lease_s
        self._acquire = self.r.register_script(_ACQUIRE)

    async def acquire(self) -> str:
        token = uuid.uuid4().hex
        delay = 0.005
        while True:
            now = time.time()
            if await self._acquire(keys=[self.key], args=[now, now + self.lease_s, self.maximum, token]):
                return token
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)

    async def renew(self, token: str) -> None:
        """Keep a held lease alive (XX: never resurrect one that was already released or expired)."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.r.zadd(self.key, {token: time.time() + self.lease_s}, xx=True)

    async def release(self, token: str) -> None:
        await self.r.zrem(self.key, token)

    async def aclose(self) -> None:
        await self.r.aclose()


class Throttle:
    """`async with throttle.slot():` around each request: the local AIMD limit, then (optionally) a global lease."""

    def __init__(self, aimd: AimdState, leases: GlobalLeases | None = None):
        self.aimd = aimd
        self.leases = leases
        self.in_flight = 0
        self._cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def slot(self):
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight < int(self.aimd.limit))
            self.in_flight += 1
        token, renewal = None, None
        try:
            if self.leases is not None:
                token = await self.leases.acquire()
                renewal = asyncio.create_task(self.leases.renew(token))
            yield
        finally:
            if renewal is not None:
                renewal.cancel()
            if token is not None:
                await self.leases.release(token)
            async with self._cond:
                self.in_flight -= 1
                self._cond.notify_all()

    async def success(self, latency_s: float) -> None:
        async with self._cond:
            self.aimd.on_success(latency_s)
            self._cond.notify_all()

    async def congestion(self) -> None:
        async with self._cond:
            self.aimd.on_congestion()

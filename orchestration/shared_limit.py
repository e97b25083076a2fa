"""An endpoint's concurrency limit shared by every worker (eyas.coordination.Limit): the state lives in Redis, one per
endpoint, so every generator worker on any machine grows and cuts the same limit (two workers are one flow to the
endpoint, not two that each slow-start and back off on their own). A request holds a lease in a sorted set, taken
only while fewer than the limit are held. Leases expire unless renewed, so a killed worker's slots come back within
`lease_s`. The state outlives a job by `state_ttl_s`: the next job on the endpoint within the hour starts from the
limit the last one found. Each change is one Lua script, so it is atomic across workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid

from eyas.coordination import Line

log = logging.getLogger(__name__)


# The state hash: limit, ssthresh, last_cut; absent fields mean a fresh endpoint (initial limit, no threshold).
# Every script returns the state after it ran, so each process's view is as fresh as its last call.
_STATE = """
local s = redis.call('HMGET', KEYS[1], 'limit', 'ssthresh', 'last_cut')
local limit, ssthresh = tonumber(s[1]) or tonumber(ARGV[1]), tonumber(s[2]) or math.huge
local last_cut = tonumber(s[3]) or 0
local maximum = tonumber(ARGV[2])
"""
_SAVE = """
redis.call('HSET', KEYS[1], 'limit', limit, 'ssthresh', ssthresh, 'last_cut', last_cut)
redis.call('EXPIRE', KEYS[1], ARGV[3])
"""
_RETURN = "return {tostring(limit), tostring(ssthresh), tostring(last_cut)}"
_HEAD = "-- ARGV: initial, maximum, state ttl, then the operation's own\n"

# KEYS: state, leases. ARGV[4..6]: now, lease expiry, token. Drop expired leases, then take one if under the limit.
_ACQUIRE = _HEAD + _STATE + """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
local ok = 0
if redis.call('ZCARD', KEYS[2]) < math.min(maximum, math.floor(limit)) then
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
  ok = 1
end
return {ok, tostring(limit), tostring(ssthresh), tostring(last_cut)}
"""
_GROW = _HEAD + _STATE + "limit = math.min(maximum, limit + tonumber(ARGV[4]))\n" + _SAVE + _RETURN
_CUT = _HEAD + _STATE + """
if last_cut < tonumber(ARGV[4]) then  -- ARGV[4..7]: sent, factor, by, now
  limit = math.max(1, limit * tonumber(ARGV[5]), limit - tonumber(ARGV[6]))
  ssthresh, last_cut = limit, tonumber(ARGV[7])
end
""" + _SAVE + _RETURN
_AT_LEAST = _HEAD + _STATE + """
limit = math.max(limit, math.min(tonumber(ARGV[4]), ssthresh, maximum))
""" + _SAVE + _RETURN


class SharedLimit:
    """The endpoint's limit in Redis, shared by every worker (see the module doc)."""

    def __init__(self, redis_url: str, endpoint: str, maximum: int, initial: float, lease_s: float = 15.0,
                 state_ttl_s: int = 3600):
        import redis.asyncio as aioredis

        # hundreds of requests answer at once: they queue for a few connections rather than fail for want of one
        self.r = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=32, timeout=None))
        key = "eyas:endpoint:" + hashlib.sha1(endpoint.encode()).hexdigest()[:16]
        self.state_key, self.leases_key = key + ":aimd", key + ":leases"
        self.maximum, self.lease_s = maximum, lease_s
        self._args = [float(min(initial, maximum)), maximum, state_ttl_s]
        self.limit, self.ssthresh = float(min(initial, maximum)), math.inf
        self._acquire, self._grow, self._cut, self._at_least = (
            self.r.register_script(s) for s in (_ACQUIRE, _GROW, _CUT, _AT_LEAST))
        # one request per process polls Redis for a lease; the others wait their turn here
        self._line, self._polling = Line(abandoned=self._pass_turn), False
        self._released = asyncio.Event()
        self._held: set[str] = set()
        self._renewer: asyncio.Task | None = None
        self._closed = False

    def _keep(self, state: list) -> None:
        self.limit, self.ssthresh = float(state[0]), float(state[1])

    def _pass_turn(self) -> None:
        self._polling = self._line.next()

    async def acquire(self, first: bool = False) -> str:
        token = uuid.uuid4().hex
        if self._polling:
            await self._line.wait(self._line.join(first))  # then it is this request's turn to poll
        self._polling = True
        try:
            delay = 0.002
            while True:
                now = time.time()
                ok, *state = await self._acquire(keys=[self.state_key, self.leases_key],
                                                 args=[*self._args, now, now + self.lease_s, token])
                self._keep(state)
                if int(ok):
                    break
                self._released.clear()  # a slot freed in this process is tried at once; others' within `delay`
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), delay)
                if asyncio.current_task().cancelling():  # 3.11's wait_for can swallow a cancel racing its timeout
                    raise asyncio.CancelledError
                delay = min(delay * 2, 0.05)
        finally:
            self._pass_turn()
        self._held.add(token)
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew())
        return token

    async def _renew(self) -> None:
        """Keep held leases alive (XX: never resurrect one that was released or had expired)."""
        from redis.exceptions import RedisError

        while not self._closed:  # (a cancel swallowed inside a command's own timeout must not keep it alive)
            await asyncio.sleep(self.lease_s / 3)
            if self._held:
                try:
                    await self.r.zadd(self.leases_key, {t: time.time() + self.lease_s for t in self._held}, xx=True)
                except RedisError as e:  # Redis briefly away: the next round renews; a lapse costs a slot
                    log.warning("could not renew endpoint leases: %s", e)

    async def release(self, token: str) -> None:
        self._held.discard(token)
        await self.r.zrem(self.leases_key, token)
        self._released.set()

    async def in_flight(self) -> int:
        async with self.r.pipeline() as p:
            p.zremrangebyscore(self.leases_key, "-inf", time.time())
            p.zcard(self.leases_key)
            return int((await p.execute())[1])

    async def grow(self, delta: float) -> None:
        self._keep(await self._grow(keys=[self.state_key], args=[*self._args, delta]))

    async def cut(self, sent: float, factor: float, by: float = math.inf) -> None:
        self._keep(await self._cut(keys=[self.state_key], args=[*self._args, sent, factor, min(by, 1e18),
                                                                time.time()]))

    async def at_least(self, n: float) -> None:
        self._keep(await self._at_least(keys=[self.state_key], args=[*self._args, n]))

    async def aclose(self) -> None:
        if self._renewer is not None:
            self._closed = True
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.r.aclose()

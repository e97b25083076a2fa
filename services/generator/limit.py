"""An endpoint's concurrency state: the limit, the slow-start threshold, when the limit was last cut, and the requests
in flight under it. The throttle (throttle.py) decides what the answers mean; a Limit keeps the state and applies
the three changes atomically:

- grow(delta): limit + delta, up to the maximum;
- cut(sent, factor, by): unless the limit was already cut since `sent`, limit × factor, or limit − by where that is
  less deep; the cut limit becomes the slow-start threshold (slow start is over);
- at_least(n): the limit is raised to n (up to the slow-start threshold and the maximum).

LocalLimit is one process's. SharedLimit keeps the state in Redis, one per endpoint, so every generator worker on
any machine grows and cuts the same limit (two workers are one flow to the endpoint, not two that each slow-start
and back off on their own); a request holds a lease in a sorted set, taken only while fewer than the limit are
held. Leases expire unless renewed, so a killed worker's slots come back within `lease_s`. The state outlives a job
by `state_ttl_s`: the next job on the endpoint within the hour starts from the limit the last one found.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Limit(Protocol):
    maximum: int
    limit: float  # the latest known values (the shared state may have moved on since)
    ssthresh: float

    async def acquire(self, first: bool = False) -> str | None: ...  # a slot under the limit (a token to release)

    async def release(self, token: str | None) -> None: ...

    async def in_flight(self) -> int: ...  # requests holding a slot, from every process sharing the limit

    async def grow(self, delta: float) -> None: ...

    async def cut(self, sent: float, factor: float, by: float = math.inf) -> None: ...

    async def at_least(self, n: float) -> None: ...

    async def aclose(self) -> None: ...


class Line:
    """Requests waiting their turn: first come, first served, except that a retry goes to the front. Its prompt has
    waited its turn once already; behind every fresh prompt it would wait a round trip more for each failure, and
    a job ends with the prompts that failed most. (SharedLimit's line is for the turn to poll Redis: a retry goes
    ahead of the requests waiting for it, not of the one polling.)"""

    def __init__(self, abandoned: Callable[[], None]):
        self._waiting: deque[asyncio.Future] = deque()
        self._abandoned = abandoned  # a request was let go but cancelled before it went on: pass on what it got

    def join(self, first: bool) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        (self._waiting.appendleft if first else self._waiting.append)(fut)
        return fut

    async def wait(self, fut: asyncio.Future) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._abandoned()
            raise

    def next(self) -> bool:
        """Let the next waiting request go; False when none waits."""
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():  # a cancelled request left its future here
                fut.set_result(None)
                return True
        return False


class LocalLimit:
    """One process's limit: waiting requests are admitted in turn (see Line) as slots free up."""

    def __init__(self, maximum: int, initial: float):
        self.maximum = maximum
        self.limit, self.ssthresh, self.last_cut = float(min(initial, maximum)), math.inf, 0.0
        self.held = 0
        self._line = Line(abandoned=self._give_back)

    def _admit(self) -> None:
        while self.held < int(self.limit) and self._line.next():
            self.held += 1

    def _give_back(self) -> None:
        self.held -= 1
        self._admit()

    async def acquire(self, first: bool = False) -> None:
        fut = self._line.join(first)
        self._admit()
        await self._line.wait(fut)

    async def release(self, token: None) -> None:
        self._give_back()

    async def in_flight(self) -> int:
        return self.held

    async def grow(self, delta: float) -> None:
        self.limit = min(float(self.maximum), self.limit + delta)
        self._admit()

    async def cut(self, sent: float, factor: float, by: float = math.inf) -> None:
        if self.last_cut < sent:
            self.limit = self.ssthresh = max(1.0, self.limit * factor, self.limit - by)
            self.last_cut = time.time()

    async def at_least(self, n: float) -> None:
        self.limit = max(self.limit, min(float(n), self.ssthresh, float(self.maximum)))
        self._admit()

    async def aclose(self) -> None:
        pass


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

        while True:
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
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self.r.aclose()

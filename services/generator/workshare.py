"""Who generates which prompt of a job: one process (LocalWork), or every generator worker that joins (SharedWork).

In service mode a job's unfinished prompts are a queue in Redis. The job's own task (the coordinator) publishes
them and asks the generate queue for helpers; any generator worker that takes a helper task joins, so a worker
added mid-job raises the job's throughput (all of them stay under the endpoint's one global maximum, see
throttle.py). Each participant claims prompts one at a time under a lease that a thread renews while it holds
them, and marks them finished once they are journaled or dead-lettered in the object store. A participant that
dies stops renewing: when its leases lapse, its prompts are claimed again (the journal keeps whatever it had
already committed). The coordinator works like a helper, then waits until every prompt is finished — taking over
lapsed claims itself — before it folds the journal into the final shards.

Keys carry the coordinator's attempt number (`round`): a redelivered coordinator publishes afresh, and helpers of
an earlier round find nothing to claim.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol

_CLAIM = """
local id = redis.call('LPOP', KEYS[1])
if not id then
  local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 1)
  if #lapsed == 0 then return false end
  id = lapsed[1]
end
redis.call('ZADD', KEYS[2], ARGV[2], id)
return id
"""  # KEYS: todo list, claims zset (id → lease expiry); ARGV: now, new expiry. A queued id, else a lapsed claim.

_RENEW = """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i]) end
"""  # XX: never resurrect a claim that was finished (removed) meanwhile


class Work(Protocol):
    def claim(self) -> str | None: ...  # a prompt id to generate, or None when nothing is left to claim

    def finished(self, ids: list[str]) -> None: ...  # ids are committed (journaled or dead-lettered)

    def open_count(self) -> int: ...  # prompts queued or claimed (by anyone else) and not yet finished

    def finished_count(self) -> int: ...

    def add_stats(self, stats: dict[str, int]) -> None: ...

    def shared_stats(self) -> dict[str, int]: ...

    def retire(self) -> None: ...  # the coordinator is done (or gave up): nothing more to hand out

    def close(self) -> None: ...


class LocalWork:
    """A job's prompts for one process (embedded mode, or a coordinator without helpers)."""

    def __init__(self, ids: list[str]):
        self._todo = deque(ids)

    def claim(self) -> str | None:
        return self._todo.popleft() if self._todo else None

    def finished(self, ids: list[str]) -> None:
        pass

    def open_count(self) -> int:
        return 0  # nobody else holds any

    def finished_count(self) -> int:
        return 0  # the generator counts its own

    def add_stats(self, stats: dict[str, int]) -> None:
        pass

    def shared_stats(self) -> dict[str, int]:
        return {}

    def retire(self) -> None:
        pass

    def close(self) -> None:
        pass


class SharedWork:
    """A job's prompts in Redis, claimed under renewed leases by every participant (see the module doc)."""

    def __init__(self, redis_url: str, job_id: str, round_: int, lease_s: float):
        import redis

        self.r = redis.Redis.from_url(redis_url, decode_responses=True)
        self.job_prefix = f"eyas:work:{job_id}:"
        base = f"{self.job_prefix}{round_}"
        self.todo, self.claims, self.done, self.stats = (f"{base}:todo", f"{base}:claims", f"{base}:done",
                                                          f"{base}:stats")
        self.lease_s = lease_s
        self._claim = self.r.register_script(_CLAIM)
        self._renew = self.r.register_script(_RENEW)
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def publish(self, ids: list[str], ttl_s: int = 7 * 86400) -> None:
        """The coordinator: make `ids` the round's work (replacing anything there). Earlier rounds' work goes, so
        helpers still on a dead coordinator's round stop after their current prompts."""
        keys = (self.todo, self.claims, self.done, self.stats)
        stale = [k for k in self.r.scan_iter(match=self.job_prefix + "*", count=1000) if k not in keys]
        with self.r.pipeline() as p:
            p.delete(*keys, *stale)
            if ids:
                p.rpush(self.todo, *ids)
            for k in keys:
                p.expire(k, ttl_s)
            p.execute()

    def claim(self) -> str | None:
        now = time.time()
        prompt_id = self._claim(keys=[self.todo, self.claims], args=[now, now + self.lease_s])
        if prompt_id is None:
            return None
        with self._lock:
            self._held.add(prompt_id)
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="eyas-work-leases", daemon=True)
            self._renewer.start()
        return prompt_id

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                held = list(self._held)
            if held:
                try:
                    self._renew(keys=[self.claims], args=[time.time() + self.lease_s, *held])
                except Exception:  # Redis briefly away: the next round renews; a lapse only means a second claim
                    pass

    def finished(self, ids: list[str]) -> None:
        """`ids` are committed (journaled or dead-lettered): nobody claims them again."""
        if not ids:
            return
        with self.r.pipeline() as p:
            p.sadd(self.done, *ids)
            p.zrem(self.claims, *ids)
            p.execute()
        with self._lock:
            self._held.difference_update(ids)

    def open_count(self) -> int:
        """Prompts queued or claimed by anyone and not finished."""
        with self.r.pipeline() as p:
            p.llen(self.todo)
            p.zcard(self.claims)
            queued, claimed = p.execute()
        return int(queued) + int(claimed)

    def finished_count(self) -> int:
        return int(self.r.scard(self.done))

    def add_stats(self, stats: dict[str, int]) -> None:
        with self.r.pipeline() as p:
            for k, v in stats.items():
                p.hincrby(self.stats, k, int(v))
            p.execute()

    def shared_stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(self.stats).items()}

    def retire(self) -> None:
        """The coordinator has everything (or gave up: cancelled, failed): helpers find nothing more to claim."""
        self.r.delete(self.todo, self.claims, self.done, self.stats)
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        self.r.close()

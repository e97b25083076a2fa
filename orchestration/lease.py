"""Leases: who is working on a job, or on a chunk of a job's work, right now.

A worker holds a named lease while it runs a task and renews it from one thread of its process; a worker that dies
stops renewing, and its leases lapse after `lease_s`. That is how the service mode tells a live task from an
orphaned one, whatever the broker does with the task's message:
- a job's task holds the job's lease for as long as it runs, so a duplicate delivery of the same job (the broker's
  redelivery, a requeue) finds it held and is dropped; a worker's sweep (orchestration.tasks) requeues a running
  job whose lease nobody holds;
- a chunk of shared work (orchestration.workshare) is worked by whoever holds its lease.

Each lease is a redis-py `Lock` (its documented token-checked acquire, `reacquire` and `release`); the project adds
only the renewing thread.
"""
from __future__ import annotations

import logging
import threading
import time

import redis
from redis.exceptions import LockError, RedisError
from redis.lock import Lock

log = logging.getLogger(__name__)


def job_lease(job_id: str) -> str:
    return f"eyas:lease:job:{job_id}"


class Lease:
    def __init__(self, leases: Leases, lock: Lock):
        self._leases, self._lock = leases, lock

    @property
    def name(self) -> str:
        return self._lock.name

    def release(self) -> None:
        self._leases._drop(self)
        try:
            self._lock.release()
        except (LockError, RedisError) as e:  # lapsed and taken by another, or Redis away: it lapses on its own
            log.debug("lease %s not released: %s", self.name, e)


class Leases:
    """This process's leases, renewed every lease_s / 3 by one thread while any is held."""

    def __init__(self, client: redis.Redis, lease_s: float):
        self.client, self.lease_s = client, lease_s
        self._held: dict[str, Lease] = {}
        self._mutex = threading.Lock()
        self._renewer: threading.Thread | None = None

    def try_hold(self, name: str) -> Lease | None:
        """The lease `name` if nobody holds it, else None (never waits)."""
        # thread_local=False: the renewing thread must see the token the acquiring thread stored
        lock = self.client.lock(name, timeout=self.lease_s, blocking=False, thread_local=False)
        if not lock.acquire():
            return None
        lease = Lease(self, lock)
        with self._mutex:
            self._held[name] = lease
            if self._renewer is None or not self._renewer.is_alive():
                self._renewer = threading.Thread(target=self._renew_loop, name="eyas-leases", daemon=True)
                self._renewer.start()
        return lease

    def held(self, name: str) -> bool:
        """Whether anyone (any process) holds the lease `name` now."""
        return bool(self.client.exists(name))

    def _drop(self, lease: Lease) -> None:
        with self._mutex:
            if self._held.get(lease.name) is lease:
                del self._held[lease.name]

    def _renew_loop(self) -> None:
        while True:
            time.sleep(self.lease_s / 3)
            with self._mutex:
                held = list(self._held.values())
                if not held:
                    self._renewer = None
                    return
            for lease in held:
                try:
                    lease._lock.reacquire()  # back to the full lease_s, only while the token is still ours
                except LockError:
                    log.warning("lease %s lapsed and was not renewed: another worker may hold it", lease.name)
                    self._drop(lease)
                except RedisError as e:  # Redis briefly away: the next round renews; a lapse costs a takeover
                    log.warning("could not renew lease %s: %s", lease.name, e)

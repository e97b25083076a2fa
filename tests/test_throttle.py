"""The generator's throttle against fake endpoints: slow start reaches the maximum in O(log) round trips, alone or as
several workers sharing one limit in Redis; a trickle of faults does not hold it back while a flood cuts it once per
round trip; against an endpoint that batches and queues like an LLM server (tests/fake_llm.py), latency — or the
server's own queue, where it publishes one — keeps the limit near what the server can run instead of queueing up
to the maximum."""
from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time

import pytest

from eyas.coordination import LocalLimit
from orchestration.shared_limit import SharedLimit
from services.generator.engine import HttpEngine
from services.generator.server_load import ServerLoad, parse_load
from services.generator.spec import SamplingParams
from services.generator.throttle import DECREASE, Throttle, initial_limit
from tests.fake_llm import FakeLLM


class RoundTrips:
    """A fake endpoint that answers in round trips: the requests that arrive together (until none has arrived for
    `quiet_s`) are answered together. `sizes[k]` is how many requests round trip k carried."""

    def __init__(self, quiet_s: float = 0.1):
        self.quiet_s = quiet_s
        self.sizes: list[int] = []
        self._pending: list[asyncio.Future] = []
        self._arrived = asyncio.Event()

    async def ask(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        self._arrived.set()
        await fut

    async def serve(self) -> None:
        while True:
            await self._arrived.wait()
            while self._arrived.is_set():  # the round is open while requests keep arriving
                self._arrived.clear()
                await asyncio.sleep(self.quiet_s)
            batch, self._pending = self._pending, []
            self.sizes.append(len(batch))
            for fut in batch:
                fut.set_result(None)


async def _drive(throttles: list[Throttle], endpoint: RoundTrips, requests: int, fails=lambda i: False) -> None:
    """Send `requests` requests through the throttles (taking turns), each answered by `endpoint`; request i fails
    (a retryable error) when fails(i)."""
    numbers = itertools.count()
    server = asyncio.create_task(endpoint.serve())

    async def worker(throttle: Throttle) -> None:
        while (i := next(numbers)) < requests:
            async with throttle.slot() as sent:
                await endpoint.ask()
                if fails(i):
                    await throttle.failure(sent)
                else:
                    await throttle.success(sent, latency_s=1.0, tokens=100)

    await asyncio.gather(*(worker(t) for t in throttles for _ in range(t.most)))
    server.cancel()


def test_slow_start_reaches_the_maximum_in_log_round_trips():
    async def main():
        endpoint = RoundTrips()
        await _drive([Throttle(LocalLimit(256, initial=4), 256)], endpoint, 3000)
        return endpoint.sizes

    sizes = asyncio.run(main())
    assert sizes[:7] == [4, 8, 16, 32, 64, 128, 256]  # doubles every round trip: log2(256 / 4) + 1 round trips
    assert set(sizes[7:-1]) == {256}  # and stays at the maximum


def test_slow_start_from_the_default_share_reaches_the_job_concurrency_in_one_round_trip():
    assert [initial_limit(c) for c in (1, 3, 8, 16, 32, 1000)] == [1, 3, 4, 8, 16, 500]

    async def main():
        endpoint = RoundTrips()
        await _drive([Throttle(LocalLimit(256, initial=initial_limit(256)), 256)], endpoint, 2000)
        return endpoint.sizes

    sizes = asyncio.run(main())
    assert sizes[:2] == [128, 256]  # latency flat: the maximum in the second round trip, after one
    assert set(sizes[1:-1]) == {256}


def test_workers_share_one_limit_and_slow_start_together(redis_url):
    """Two workers (two SharedLimits on one endpoint, as two processes would have) are one flow: together they
    double from the initial limit each round trip and never hold more than the one maximum."""
    async def main():
        endpoint = RoundTrips(quiet_s=0.2)  # Redis round trips are slower than in-process ones
        limits = [SharedLimit(redis_url, "http://shared-slow-start", maximum=64, initial=2) for _ in range(2)]
        throttles = [Throttle(limit, 64) for limit in limits]
        try:
            await _drive(throttles, endpoint, 1000)
        finally:
            for t in throttles:
                await t.aclose()
        return endpoint.sizes

    sizes = asyncio.run(main())
    assert sizes[:6] == [2, 4, 8, 16, 32, 64], sizes
    assert max(sizes) == 64


def test_a_worker_keeps_its_own_cap_under_a_larger_shared_limit(redis_url):
    """EYAS_WORKER_MAX_IN_FLIGHT: a worker whose share is 3 keeps 3 in flight, even though the job's limit it
    shares in Redis allows 16 and it has more requests ready."""
    async def main():
        endpoint = RoundTrips(quiet_s=0.2)
        limit = SharedLimit(redis_url, "http://own-cap", maximum=16, initial=16)
        throttle = Throttle(limit, 3)
        numbers = itertools.count()
        server = asyncio.create_task(endpoint.serve())

        async def worker():
            while next(numbers) < 30:
                async with throttle.slot() as sent:
                    await endpoint.ask()
                await throttle.success(sent, latency_s=1.0, tokens=100)
        try:
            await asyncio.gather(*(worker() for _ in range(8)))
        finally:
            server.cancel()
            await throttle.aclose()
        return endpoint.sizes

    sizes = asyncio.run(main())
    assert max(sizes) == 3 and sum(sizes) == 30, sizes


def test_a_trickle_of_faults_does_not_hold_the_limit_back():
    async def main():
        endpoint, throttle = RoundTrips(), Throttle(LocalLimit(256, initial=4), 256)
        await _drive([throttle], endpoint, 3000, fails=lambda i: i % 5 == 0)  # 20 % of answers are errors
        return endpoint.sizes, throttle.limit

    sizes, limit = asyncio.run(main())
    assert limit.ssthresh == math.inf  # never cut
    # the 80 % that succeed grow it: ×1.8 every round trip, so still O(log) round trips to the maximum
    assert sizes.index(256) <= math.ceil(math.log(256 / 4, 1.8)), sizes


def test_a_flood_of_errors_cuts_once_per_round_trip_then_the_limit_grows_back_by_one():
    async def main():
        endpoint, throttle = RoundTrips(), Throttle(LocalLimit(64, initial=64), 64)
        await _drive([throttle], endpoint, 400, fails=lambda i: i < 160)  # every request fails, then none
        return endpoint.sizes

    sizes = asyncio.run(main())
    assert sizes[:4] == [64, int(64 * DECREASE), int(64 * DECREASE ** 2), int(64 * DECREASE ** 3)], sizes
    recovered = sizes[sizes.index(min(sizes)):-1]  # AIMD: about one more every round trip
    assert len(recovered) > 5 and recovered[-1] - recovered[0] >= len(recovered) - 2, sizes
    assert all(b - a in (0, 1) for a, b in itertools.pairwise(recovered)), sizes


def test_a_retry_goes_ahead_of_fresh_requests():
    async def main():
        limit, order = LocalLimit(1, initial=1), []

        async def take(name: str, first: bool) -> None:
            token = await limit.acquire(first)
            order.append(name)
            await limit.release(token)

        token = await limit.acquire()
        waiting = [asyncio.create_task(take("fresh", False))]
        await asyncio.sleep(0.01)
        waiting.append(asyncio.create_task(take("retry", True)))
        await asyncio.sleep(0.01)
        await limit.release(token)
        await asyncio.gather(*waiting)
        return order

    assert asyncio.run(main()) == ["retry", "fresh"]


def test_a_cut_counts_once_for_every_worker_sharing_the_limit(redis_url):
    async def main():
        a, b = (SharedLimit(redis_url, "http://shared-cut", maximum=100, initial=100) for _ in range(2))
        try:
            sent = time.time()
            await a.cut(sent, 0.5)
            await b.cut(sent - 0.001, 0.5)  # the same congestion, seen by another worker: already answered
            await b.grow(0.0)
            assert a.limit == 50 and b.limit == 50 and b.ssthresh == 50
            await b.cut(time.time(), 0.5, by=5)  # a new signal, from the server's queue: by what waits
            await a.grow(1.0)
            assert a.limit == 46
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(main())


def test_a_dead_workers_leases_expire_and_held_ones_are_renewed(redis_url):
    async def main():
        def limit():
            return SharedLimit(redis_url, "http://lease-test", maximum=1, initial=1, lease_s=1.0)

        dead = limit()
        await dead.acquire()
        await dead.aclose()  # its worker was killed: it neither renews nor releases the lease
        live = limit()
        t0 = time.monotonic()
        token = await asyncio.wait_for(live.acquire(), timeout=5)  # renewed in the background while held
        waited = time.monotonic() - t0
        await asyncio.sleep(2.0)  # past its lease
        other = limit()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(other.acquire(), timeout=0.5)
        await live.release(token)
        await asyncio.wait_for(other.acquire(), timeout=2)
        for g in (live, other):
            await g.aclose()
        return waited

    assert 0.5 < asyncio.run(main()) < 3.0


async def _against(server: FakeLLM, url: str, requests: int, maximum: int) -> Throttle:
    """`requests` chat requests at up to `maximum` in flight, through a throttle that reads the server's load."""
    engine = HttpEngine(url, "target", max_connections=maximum)
    throttle = Throttle(LocalLimit(maximum, initial=4), maximum, latency_factor=4.0, load=ServerLoad(url))
    params = SamplingParams(max_tokens=256)
    numbers = itertools.count()

    async def worker() -> None:
        while (i := next(numbers)) < requests:
            async with throttle.slot() as sent:
                c = await engine.chat([{"role": "user", "content": f"Question {i}?"}], params)
                await throttle.success(sent, c.latency_s, c.completion_tokens)

    try:
        await asyncio.gather(*(worker() for _ in range(maximum)))
    finally:
        await throttle.aclose()
        await engine.aclose()
    return throttle


@pytest.mark.parametrize("publishes_queue", [True, False], ids=["server-queue", "latency"])
def test_the_limit_settles_near_what_the_server_runs(publishes_queue):
    """16 batch slots and a job that allows 256 in flight: 256 in flight would keep 240 waiting at the server. The
    server's queue, or else latency, holds the limit near the 16 it can run, with its slots full."""
    server = FakeLLM(slots=16, token_s=0.001, full_batch_slowdown=2.0, metrics=publishes_queue)
    with server as url:
        throttle = asyncio.run(_against(server, url, 600, maximum=256))
    trace = server.stats["trace"]
    second_half = [(running, waiting) for _, running, waiting in trace[len(trace) // 2:]]
    waiting = statistics.median(w for _, w in second_half)
    assert throttle.limit.ssthresh < 256 and throttle.limit.limit < 256  # congestion ended slow start
    assert max(r for r, _ in second_half) == 16  # the slots were full
    assert waiting <= (4 if publishes_queue else 48), (waiting, throttle.limit.limit)  # unthrottled: ~150


def test_server_load_from_vllm_and_sglang_metrics():
    vllm = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 30.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 12.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    load = parse_load(vllm)
    assert (load.running, load.waiting) == (42.0, 3.0)  # engines summed
    load = parse_load("sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 2\n")
    assert (load.running, load.waiting) == (7.0, 2.0)
    assert parse_load("process_cpu_seconds_total 3.0\n") is None  # a Prometheus page, but no scheduler gauges

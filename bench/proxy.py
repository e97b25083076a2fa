"""Traffic pass-through benchmark: what `eyas proxy` (recording on, every chat request sampled, answers kept: the
most work it does per request) adds in front of an endpoint, beside the bare endpoint, at the same concurrency.

The endpoint is tests/fake_llm.py in a process of its own, answering every request with one token after a fixed
time (--answer-ms, whatever the batch), so a request's latency is that time plus what is in front of it. The proxy is
`eyas proxy` in another process, storing its windows in a temporary workdir. One client (asyncio httpx, `-C`
requests in flight) runs --requests chat requests per leg in ABBA order (bare, proxy, proxy, bare) after a warm-up of
each; latencies pool per side. Added latency is the proxy side's percentile minus the bare side's; throughput is
requests/s over a leg's wall time; the proxy's CPU per request comes from its /proc counters over its legs.

    .venv/bin/python bench/proxy.py              # C = 64, 2,000 requests a leg, 20 ms answers
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.fake_llm import FakeLLM  # noqa: E402
from tests.servers import free_port, wait_http  # noqa: E402


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def leg(url: str, n: int, concurrency: int) -> tuple[list[float], float]:
    """Latencies (s) of n chat requests with `concurrency` in flight, and the leg's wall time."""
    latencies: list[float] = []
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60, trust_env=False) as client:
        async def worker() -> None:
            for i in todo:
                body = {"model": "target", "max_tokens": 1,
                        "messages": [{"role": "user", "content": f"question {i}: write to me@example.org"}]}
                t = time.perf_counter()
                r = await client.post("/v1/chat/completions", content=json.dumps(body).encode(),
                                      headers={"content-type": "application/json"})
                latencies.append(time.perf_counter() - t)
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-C", "--concurrency", type=int, default=64, help="requests in flight")
    ap.add_argument("--requests", type=int, default=2000, help="requests per leg (4 legs, ABBA)")
    ap.add_argument("--warmup", type=int, default=300, help="requests to each side before the legs")
    ap.add_argument("--answer-ms", type=float, default=20.0, help="the endpoint's time to answer")
    ap.add_argument("--sample", type=float, default=1.0, help="the proxy's sampled fraction of chat requests")
    args = ap.parse_args()

    port, proxy_port = free_port(), free_port()
    fake = FakeLLM(slots=4096, token_s=args.answer_ms / 1000, full_batch_slowdown=1.0)
    endpoint = multiprocessing.Process(target=fake.serve_forever, args=(port,), daemon=True)
    endpoint.start()
    bare = f"http://127.0.0.1:{port}"
    wait_http(f"{bare}/metrics")
    with tempfile.TemporaryDirectory(prefix="eyas-bench-proxy-") as tmp:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "orchestration.cli", "proxy", "--upstream", bare, "--port", str(proxy_port),
             "--record", "--sample", str(args.sample), "--record-answers", "--max-records-per-minute", "10000000",
             "--workdir", tmp], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        through = f"http://127.0.0.1:{proxy_port}"
        try:
            wait_http(f"{through}/metrics")
            run(args, bare, through, proxy.pid)
        finally:
            proxy.terminate()
            proxy.wait(30)
            endpoint.kill()
        windows = list(Path(tmp).rglob("traffic/*.jsonl"))
        records = sum(len(w.read_text().splitlines()) for w in windows)
        print(f"recorded: {records} requests in {len(windows)} windows")


def run(args, bare: str, through: str, proxy_pid: int) -> None:
    for url in (bare, through):
        asyncio.run(leg(url, args.warmup, args.concurrency))
    lat = {"bare": [], "proxy": []}
    walls = {"bare": 0.0, "proxy": 0.0}
    cpu = 0.0
    for side in ("bare", "proxy", "proxy", "bare"):
        before = _cpu_s(proxy_pid)
        xs, wall = asyncio.run(leg(bare if side == "bare" else through, args.requests, args.concurrency))
        cpu += _cpu_s(proxy_pid) - before if side == "proxy" else 0.0
        lat[side] += xs
        walls[side] += wall
        print(f"  {side:5s} leg: {args.requests / wall:7.1f} req/s, p50 {_pct(xs, 50) * 1e3:6.2f} ms", flush=True)
    thr = {s: 2 * args.requests / walls[s] for s in walls}
    print(f"C = {args.concurrency}, {args.requests} requests a leg, answers in {args.answer_ms:g} ms, "
          f"proxy sampling {args.sample:g} with answers")
    print("| side | p50 ms | p99 ms | req/s |\n|---|---|---|---|")
    for s in ("bare", "proxy"):
        print(f"| {s} | {_pct(lat[s], 50) * 1e3:.2f} | {_pct(lat[s], 99) * 1e3:.2f} | {thr[s]:.1f} |")
    print(f"added latency: p50 {(_pct(lat['proxy'], 50) - _pct(lat['bare'], 50)) * 1e3:.2f} ms, "
          f"p99 {(_pct(lat['proxy'], 99) - _pct(lat['bare'], 99)) * 1e3:.2f} ms; "
          f"throughput {thr['proxy'] / thr['bare']:.3f} × the bare endpoint's; "
          f"proxy CPU {cpu / (2 * args.requests) * 1e3:.3f} ms per request")


if __name__ == "__main__":
    main()

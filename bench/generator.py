"""Generator benchmark: `eyas generate` against an endpoint that behaves like an LLM server under load, beside a bare
asyncio httpx client at the best fixed concurrency a sweep finds, without and with 20 % injected faults; and 1, 2 and
4 `eyas generate` processes sharing one endpoint limit through Redis.

The endpoint is tests/fake_llm.py in a process of its own: a fixed number of batch slots, a time per output token
that grows with the batch, a waiting queue beyond the slots, long-tailed generation lengths; the faults come from
tests/fault_proxy.py (in another process) in front of it. Time is scaled down: at the defaults a generation takes
~0.5–4 s where a real reasoning model takes 30–60 s, so one run is a few minutes, not hours. Wall time is measured at
the endpoint, from the first request to the last answer: process start-up (imports, tokenizer) and writing the
shards at the end are the same for every size of job and are left out. The number of prompts is `--rounds` round
trips' worth at the server's full batch.

    .venv/bin/python bench/generator.py --concurrency 64 200 1000
    .venv/bin/python bench/generator.py --concurrency 200 --faults 20 --repeat 5  # one row, median of 5 runs
    .venv/bin/python bench/generator.py --workers 1 2 4 --concurrency 200
    .venv/bin/python bench/generator.py --fast  # client CPU: requests/s against an endpoint answering in 20 ms

`--fast` measures what one process costs per request rather than how it fills a batch: every answer is one token at
`--answer-ms` (20 ms, whatever the batch), 1,200 prompts at concurrency 32; requests/s of `eyas generate` beside the
bare client, and the eyas process's CPU time per request.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the fake endpoint and the fault proxy are the tests' fixtures

from tests.fake_llm import FakeLLM  # noqa: E402
from tests.fault_proxy import FaultProxy  # noqa: E402
from tests.servers import free_port, redis_server, wait_http  # noqa: E402

RETRY_WAIT_S = 0.05  # eyas's first retry waits 0.5 s by default: scaled down with the generations
BARE_POOL = 16  # connections per httpx client of the bare client
FAULTS = {"delay": 0.04, "429": 0.04, "500": 0.04, "503": 0.04, "reset": 0.04, "truncate": 0.04}  # 24 % of requests


def _serve_faults(upstream: str, timeout_s: float, conn) -> None:
    # a hung request times out at the client; Retry-After and eyas's retry waits are scaled with the generations
    with FaultProxy(upstream, FAULTS, delay_s=timeout_s + 1, retry_after="0") as url:
        conn.send(url)
        conn.recv()  # until the benchmark is done


def _measure(server: str) -> dict:
    """Wall time at the endpoint, and how long the batch took to reach its steady size (90 % of its median over the
    middle half of the run)."""
    s = httpx.get(f"{server}/stats", timeout=30).json()
    t0, t1 = s["first_request"], s["last_answer"]
    trace = [(t - t0, running) for t, running, _ in s["trace"] if t0 <= t <= t1]
    wall = t1 - t0
    steady = statistics.median(r for t, r in trace if wall / 4 <= t <= wall * 3 / 4)
    to_steady = next(t for t, r in trace if r >= 0.9 * steady)
    return {"wall": wall, "steady_batch": steady, "to_steady": to_steady, "answers": s["answers"]}


async def bare(url: str, n: int, concurrency: int, max_tokens: int, timeout_s: float) -> int:
    """The plain alternative: a semaphore, httpx clients of BARE_POOL connections taken in turn (httpx's pool
    does work per connection on every request: one pool of 32 manages a third of the requests per second), and a
    retry loop (without one, faults lose prompts)."""
    sem = asyncio.Semaphore(concurrency)
    retries = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    clients = [httpx.AsyncClient(limits=limits, timeout=timeout_s) for _ in range(-(-concurrency // BARE_POOL))]
    turn = itertools.cycle(clients)
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)

        async def one(i: int) -> None:
            nonlocal retries
            body = {"model": "target", "messages": [{"role": "user", "content": f"Question {i}?"}],
                    "max_tokens": max_tokens}
            async with sem:
                while True:
                    try:
                        r = await next(turn).post(f"{url}/v1/chat/completions", json=body)
                        if r.status_code == 200:
                            r.json()["choices"][0]["message"]["content"]
                            return
                    except (httpx.HTTPError, ValueError, KeyError):
                        pass
                    retries += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return retries


def _prompts(path: Path, ids: range) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]})
                            + "\n" for i in ids))
    return path


def eyas(url: str, prompt_files: list[Path], concurrency: int, max_tokens: int, timeout_s: float, tmp: Path,
         env: dict[str, str] | None = None) -> dict:
    """`eyas generate` once per prompt file, all at once; then what the committed shards hold."""
    env = {**os.environ, "TQDM_DISABLE": "1", "EYAS_WORKER_MAX_IN_FLIGHT": str(concurrency),
           "EYAS_ALLOWED_ENDPOINTS": url, "EYAS_INPUT_ROOTS": str(prompt_files[0].parent), **(env or {})}
    procs, outs = [], []
    for k, prompts in enumerate(prompt_files):
        out, log = tmp / f"out{k}", open(tmp / f"eyas{k}.log", "wb")
        outs.append(out)
        procs.append(subprocess.Popen(
            [str(REPO / ".venv/bin/eyas"), "generate", "--prompts", str(prompts), "--endpoint", url,
             "--concurrency", str(concurrency), "--max-tokens", str(max_tokens), "--request-timeout-s",
             str(timeout_s), "--max-attempts", "30", "--retry-wait-s", str(RETRY_WAIT_S), "--out", str(out),
             "--workdir", str(tmp / f"work{k}")],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    for k, p in enumerate(procs):
        if p.wait() != 0:
            raise RuntimeError(f"eyas generate failed:\n{(tmp / f'eyas{k}.log').read_text()[-3000:]}")
    ids, dead = [], 0
    for out in outs:
        ids += [json.loads(line)["id"] for f in sorted(out.glob("conversations-*.jsonl"))
                for line in f.read_text().splitlines()]
        if (out / "dead-letter.jsonl").exists():
            dead += len((out / "dead-letter.jsonl").read_text().splitlines())
    expected = sum(len(f.read_text().splitlines()) for f in prompt_files)
    return {"lost": expected - len(set(ids)) - dead, "duplicated": len(ids) - len(set(ids)), "dead": dead}


def _run(server: str, what) -> dict:
    httpx.post(f"{server}/stats/reset", timeout=10)
    extra = what() or {}
    return {**_measure(server), **extra}


def compare(args, server: str, faulty: str, concurrency: int, tmp: Path) -> list[dict]:
    n = args.rounds * min(concurrency, args.slots)
    prompts = _prompts(tmp / f"prompts-{concurrency}.jsonl", range(n))
    timeout = args.timeout_s
    # fixed concurrencies from C down to half of what the server runs at once (fewer only leave slots idle)
    sweep = [c for c in (concurrency, concurrency // 2, concurrency // 4)
             if c == concurrency or c >= min(concurrency, args.slots) / 2]
    walls = {c: _run(server, lambda c=c: {"retries": asyncio.run(bare(server, n, c, args.max_tokens, timeout))})
             for c in sweep}
    for c, r in walls.items():
        print(f"  bare at {c:5d}: {r['wall']:6.1f} s", flush=True)
    best = min(walls, key=lambda c: walls[c]["wall"])
    rows = []
    for key, label, url in (("none", "none", server), ("20", "20 %", faulty)):
        if key not in args.faults:
            continue
        for run in range(args.repeat):  # faults are drawn per request: one run is one draw of who waits longest
            plain = walls[best] if url == server and run == 0 else _run(
                server, lambda url=url: {"retries": asyncio.run(bare(url, n, best, args.max_tokens, timeout))})
            with tempfile.TemporaryDirectory(dir=tmp) as t:
                ours = _run(server, lambda url=url, t=t: eyas(url, [prompts], concurrency, args.max_tokens, timeout,
                                                              Path(t)))
            rows.append({"C": concurrency, "faults": label, "run": run + 1, "prompts": n, "best": best,
                         "bare": plain["wall"], "eyas": ours["wall"], "ratio": ours["wall"] / plain["wall"],
                         "lost": ours["lost"], "duplicated": ours["duplicated"], "dead": ours["dead"],
                         "to_steady": ours["to_steady"], "bare_to_steady": plain["to_steady"],
                         "batch": ours["steady_batch"]})
            r = rows[-1]
            print(f"  faults {label}, run {run + 1}: bare {r['bare']:.1f} s, eyas {r['eyas']:.1f} s "
                  f"(x{r['ratio']:.3f}), steady after {r['to_steady']:.1f} s", flush=True)
    return rows


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fast(args, server: str, tmp: Path) -> None:
    """Requests/s of one `eyas generate` process and of the bare client against an endpoint that answers every
    request in --answer-ms: the client's own cost per request, not the server's batch, sets the rate."""
    n, c = args.prompts, args.concurrency[0]
    prompts = _prompts(tmp / "prompts-fast.jsonl", range(n))
    with tempfile.TemporaryDirectory(dir=tmp) as t:  # the process's fixed cost: imports, tokenizer, one request
        cpu = _child_cpu_s()
        eyas(server, [_prompts(tmp / "prompts-one.jsonl", range(1))], c, 1, args.timeout_s, Path(t))
        fixed = _child_cpu_s() - cpu
    rows = []
    for _ in range(args.repeat):
        plain = _run(server, lambda: {"retries": asyncio.run(bare(server, n, c, 1, args.timeout_s))})
        with tempfile.TemporaryDirectory(dir=tmp) as t:
            cpu = _child_cpu_s()
            ours = _run(server, lambda t=t: eyas(server, [prompts], c, 1, args.timeout_s, Path(t)))
            ours["cpu"] = _child_cpu_s() - cpu  # the whole process: start-up (imports, tokenizer) included
        rows.append((plain, ours))
        print(f"  bare {plain['answers'] / plain['wall']:.0f} req/s, eyas {ours['answers'] / ours['wall']:.0f} req/s "
              f"({ours['lost']} lost, {ours['duplicated']} duplicated, {ours['dead']} dead); median batch: bare "
              f"{plain['steady_batch']:.0f}, eyas {ours['steady_batch']:.0f}", flush=True)
    print(f"\n{n} prompts at concurrency {c}, every answer in {args.answer_ms:g} ms; requests/s at the endpoint "
          f"(first request to last answer)")
    print(f"eyas CPU per request: the process's CPU time less that of a one-prompt run ({fixed:.1f} s: imports, "
          f"tokenizer), over the other requests")
    print("| run | bare (req/s) | eyas (req/s) | eyas / bare | eyas CPU per request (ms) | lost | duplicated | "
          "dead-lettered |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (plain, ours) in enumerate(rows):
        b, e = plain["answers"] / plain["wall"], ours["answers"] / ours["wall"]
        print(f"| {k + 1} | {b:.0f} | {e:.0f} | {e / b:.3f} | "
              f"{1000 * (ours['cpu'] - fixed) / (ours['answers'] - 1):.2f} "
              f"| {ours['lost']} | {ours['duplicated']} | {ours['dead']} |")


def workers(args, server: str, concurrency: int, tmp: Path) -> None:
    n = args.rounds * min(concurrency, args.slots)
    with redis_server() as redis_url:
        env = {"EYAS_MODE": "service", "EYAS_REDIS_URL": redis_url}
        rows = []
        for k in args.workers:
            redis.Redis.from_url(redis_url).flushdb()  # each run slow-starts: no limit learned by the one before
            files = [_prompts(tmp / f"w{k}-{j}.jsonl", range(j, n, k)) for j in range(k)]
            with tempfile.TemporaryDirectory(dir=tmp) as t:
                r = _run(server, lambda files=files, t=t: eyas(server, files, concurrency, args.max_tokens,
                                                                args.timeout_s, Path(t), env))
            rows.append((k, r))
            print(f"  {k} workers: {r['wall']:.1f} s", flush=True)
    one = rows[0][1]["wall"]
    print(f"\n{n} prompts at concurrency {concurrency}, {args.slots}-slot endpoint; workers share one limit (Redis)")
    print("| workers | wall (s) | throughput vs 1 worker | lost | duplicated | steady after (s) |")
    print("|---|---|---|---|---|---|")
    for k, r in rows:
        print(f"| {k} | {r['wall']:.1f} | {one / r['wall']:.3f} | {r['lost']} | {r['duplicated']} | "
              f"{r['to_steady']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", help="the job's concurrency (C); 64 200 1000 by default")
    ap.add_argument("--workers", type=int, nargs="*", help="compare this many worker processes instead (e.g. 1 2 4)")
    ap.add_argument("--rounds", type=int, default=15, help="prompts: this many round trips at the full batch")
    ap.add_argument("--slots", type=int, default=256, help="the endpoint's batch slots (vLLM's max_num_seqs)")
    ap.add_argument("--token-ms", type=float, default=4.0, help="ms per output token with one request running")
    ap.add_argument("--slowdown", type=float, default=3.0, help="time per token at a full batch, relative to one")
    ap.add_argument("--max-tokens", type=int, default=1024, help="per request; lengths are log-normal below it")
    ap.add_argument("--timeout-s", type=float, default=20.0, help="request timeout, for both clients")
    ap.add_argument("--fast", action="store_true", help="requests/s against an endpoint answering in --answer-ms "
                    "(the client's CPU per request); --concurrency 32 and --prompts 1200 unless given")
    ap.add_argument("--answer-ms", type=float, default=20.0, help="--fast: every answer's latency")
    ap.add_argument("--prompts", type=int, default=1200, help="--fast: prompts per run")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each row (bare, then eyas, each time); with "
                    "more than one, the table ends with each row's median ratio")
    ap.add_argument("--faults", nargs="+", choices=("none", "20"), default=["none", "20"],
                    help="the rows to run: without faults, with 20 %% of requests faulted, or both")
    ap.add_argument("--no-metrics", action="store_true", help="the endpoint publishes no queue: latency steers")
    args = ap.parse_args()
    args.concurrency = args.concurrency or ([32] if args.fast else [64, 200, 1000])

    port = free_port()
    if args.fast:  # one-token answers at a fixed time per token whatever the batch: every answer takes answer-ms
        fake = FakeLLM(slots=args.slots, token_s=args.answer_ms / 1000, full_batch_slowdown=1.0,
                       metrics=not args.no_metrics)
    else:
        fake = FakeLLM(slots=args.slots, token_s=args.token_ms / 1000, full_batch_slowdown=args.slowdown,
                       metrics=not args.no_metrics)
    procs = [multiprocessing.Process(target=fake.serve_forever, args=(port,), daemon=True)]
    procs[0].start()
    server = f"http://127.0.0.1:{port}"
    wait_http(f"{server}/stats")
    ours, theirs = multiprocessing.Pipe()
    procs.append(multiprocessing.Process(target=_serve_faults, args=(server, args.timeout_s, theirs), daemon=True))
    procs[1].start()
    faulty = ours.recv()
    try:
        with tempfile.TemporaryDirectory(prefix="eyas-bench-") as tmp:
            if args.fast:
                fast(args, server, Path(tmp))
                return
            if args.workers:
                for c in args.concurrency:
                    workers(args, server, c, Path(tmp))
                return
            rows = []
            for c in args.concurrency:
                print(f"C = {c}: {args.rounds * min(c, args.slots)} prompts", flush=True)
                rows += compare(args, server, faulty, c, Path(tmp))
    finally:
        for p in procs:
            p.kill()
    print(f"\n{args.slots}-slot endpoint, {args.token_ms} ms/token alone, x{args.slowdown} at a full batch, "
          f"max_tokens {args.max_tokens}, {'no queue published' if args.no_metrics else 'queue on /metrics'}")
    print("| C | faults | run | prompts | best fixed C (bare) | bare (s) | eyas (s) | eyas / bare | lost | "
          "duplicated | dead-lettered | eyas steady after (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['C']} | {r['faults']} | {r['run']} | {r['prompts']} | {r['best']} | {r['bare']:.1f} | "
              f"{r['eyas']:.1f} | {r['ratio']:.3f} | {r['lost']} | {r['duplicated']} | {r['dead']} | "
              f"{r['to_steady']:.1f} |")
    if args.repeat > 1:
        for (c, label), group in itertools.groupby(rows, key=lambda r: (r["C"], r["faults"])):
            ratios = [r["ratio"] for r in group]
            print(f"C = {c}, faults {label}: median eyas / bare {statistics.median(ratios):.3f} over {len(ratios)} "
                  f"runs ({min(ratios):.3f}–{max(ratios):.3f})")


if __name__ == "__main__":
    main()

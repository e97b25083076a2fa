"""Generator benchmark: Eyas's generator (retries, AIMD throttle, journal) vs a bare asyncio httpx client at the
same concurrency, against the same fast local OpenAI-compatible endpoint (a canned-answer server in another
process, so the clients are what is measured). Runs alternate, side by side; prints both throughputs and the ratio.

    .venv/bin/python bench/generator.py [--requests 2000] [--concurrency 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import tempfile
import time
from pathlib import Path

import httpx

_ANSWER = json.dumps({
    "id": "x", "object": "chat.completion", "model": "target",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "A canned answer of a few words.",
                             "reasoning_content": "Short thought."}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20},
}).encode()


def _serve(port: int) -> None:
    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    asyncio.run(main())


async def bare(url: str, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(i: int):
            async with sem:
                r = await client.post(f"{url}/v1/chat/completions", json={
                    "model": "target", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 16})
                r.json()["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return n / (time.perf_counter() - t0)


def eyas(url: str, n: int, concurrency: int) -> float:
    from eyas.jobs import JobRecord, SqliteJobStore
    from eyas.settings import Settings
    from eyas.stages import StageContext
    from eyas.store import Artifact, LocalStore
    from services.generator.core import Generator, Journal, Spec, _make_throttle
    from services.generator.dataset import Prompt
    from services.generator.engine import HttpEngine
    from services.generator.workshare import LocalWork

    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "p.jsonl"
        prompts_file.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
        spec = Spec(prompts=str(prompts_file), endpoint=url, concurrency=concurrency,
                    initial_concurrency=concurrency, sampling={"max_tokens": 16}, held_out=None)
        jobs = SqliteJobStore(Path(tmp) / "jobs.sqlite")
        jobs.put(JobRecord(id="bench", stage="generate", spec={}))
        out = Artifact(LocalStore(Path(tmp) / "out"))
        ctx = StageContext(job_id="bench", settings=Settings(workdir=Path(tmp)), store=out.store, jobs=jobs,
                           output=out)
        prompts = [Prompt(id=f"p{i}", user_turns=[f"q{i}"]) for i in range(n)]

        async def main() -> float:
            engine = HttpEngine(url, "target", max_connections=concurrency)
            journal = Journal(out, flush_every=256)
            gen = Generator(spec, engine, _make_throttle(spec, ctx.settings), journal, ctx)
            t0 = time.perf_counter()
            await gen.run({p.id: p for p in prompts}, LocalWork([p.id for p in prompts]))
            elapsed = time.perf_counter() - t0
            await engine.aclose()
            assert len(journal.load()) == n and gen.stats["failed"] == 0
            return n / elapsed

        return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.post(f"{url}/v1/chat/completions", json={}, timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    import logging
    import os

    logging.disable(logging.INFO)
    os.environ["TQDM_DISABLE"] = "1"  # the progress bar is not what is measured
    rates: dict[str, list[float]] = {"bare": [], "eyas": []}
    try:
        for _ in range(args.repeats):  # alternate, so both see the same machine state
            rates["bare"].append(asyncio.run(bare(url, args.requests, args.concurrency)))
            rates["eyas"].append(eyas(url, args.requests, args.concurrency))
    finally:
        server.kill()
    best = {k: max(v) for k, v in rates.items()}
    print(f"{args.requests} requests at concurrency {args.concurrency}, best of {args.repeats}")
    print(f"bare asyncio httpx client: {best['bare']:8.1f} req/s")
    print(f"eyas generator:            {best['eyas']:8.1f} req/s")
    print(f"ratio eyas/bare: {best['eyas'] / best['bare']:.3f}  (goal >= 0.97)")


if __name__ == "__main__":
    main()

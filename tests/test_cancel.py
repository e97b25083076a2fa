"""Cancel within seconds in every stage: a running job whose cancel is requested (as the API does:
orchestration.jobs.request_cancel) is `cancelled` within CANCEL_S, whatever its stage is doing — between decoding
steps (generate, evaluate), forward batches (extract), training steps (train) — and leaves no half-written
artifact: no manifest, a generator journal of whole samples a rerun resumes from, whole shards, checkpoints a
resumed training continues from.

Each stage runs for real on the bundled target on the CPU (execute() on a thread, as a worker runs it); the work
is sized to last well past the cancel."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import pytest
from safetensors.torch import load_file

from eyas.settings import Settings
from eyas.stage import Cancelled, StageContext
from eyas.target import BUNDLED, load_target
from orchestration.cancel_watch import CancelWatch
from orchestration.embedded import EmbeddedRunner
from orchestration.execution import execute, job_output, submit
from orchestration.jobs import TERMINAL, JobRecord, request_cancel, transition
from services.generator.journal import Journal
from services.generator.spec import SamplingParams
from services.trainer.checkpoint import load_checkpoint
from services.trainer.spec import CPU_PRESET
from tests.datasets import CONVERSATIONS, write_records
from tests.fake_llm import FakeLLM

CANCEL_S = 5.0  # the most seconds from the cancel request to `cancelled`
START_S = 180.0  # the most seconds a job may take to be mid-work (a loaded machine loads the target slowly)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> EmbeddedRunner:
    # the tests' own temporary directories hold the files they name
    return EmbeddedRunner(Settings(workdir=tmp_path_factory.mktemp("cancel"),
                                   input_roots=[tmp_path_factory.getbasetemp()]))


def _conversations(n: int) -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": f"{q} (#{i})"},
                                         {"role": "assistant", "content": a}]}
            for i, (q, a) in enumerate(CONVERSATIONS[i % len(CONVERSATIONS)] for i in range(n))]


@pytest.fixture(scope="module")
def features(runner, tmp_path_factory) -> str:
    data = write_records(tmp_path_factory.mktemp("data") / "small", _conversations(12))
    [job] = runner.run_job("extract", {"data": data})
    assert job.state == "succeeded", job.error
    return job.artifacts["output"]


@pytest.fixture(scope="module")
def drafter(runner, features) -> str:
    [job] = runner.run_job("train", {"features": features, **CPU_PRESET, "steps": 2, "warmup": 1, "val_every": 4,
                                     "val_interval": 0})
    assert job.state == "succeeded", job.error
    return job.artifacts["output"]


def _cancel_mid_work(runner: EmbeddedRunner, stage: str, spec: dict,
                     mid_work: Callable[[JobRecord], bool]) -> tuple[JobRecord, float]:
    """Run a job as a worker does (execute() on a thread of its own), request its cancel once `mid_work(record)`,
    and return its record once it ended and the seconds from the request to that."""
    job = submit(stage, spec, runner.jobs, lambda *_: None, runner.settings)
    raised: queue.Queue[BaseException] = queue.Queue()

    def work() -> None:
        try:
            execute(job.id, runner.jobs, runner.store, runner.settings, lambda *_: None)
        except BaseException as e:  # noqa: BLE001 - the test names it
            raised.put(e)

    thread = threading.Thread(target=work, name=f"test-{job.id}", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not mid_work(record := runner.jobs.get(job.id)):
        assert record.state not in TERMINAL, f"the job ended before it was cancelled: {record}"
        assert time.monotonic() < deadline, f"the job was not mid-work within {START_S:g} s: {record}"
        time.sleep(0.05)
    asked = time.monotonic()
    request_cancel(runner.jobs, job.id)
    while (record := runner.jobs.get(job.id)).state not in TERMINAL and time.monotonic() - asked < 60:
        time.sleep(0.05)
    took = time.monotonic() - asked
    thread.join(60)
    assert not thread.is_alive(), "the job's run did not return"
    assert raised.empty(), raised.get()
    print(f"{stage}: cancelled {took:.2f} s after the request (at {record.progress.done}/{record.progress.total} "
          f"{record.progress.unit})", file=sys.stderr)
    return record, took


def _reported(at_least: int) -> Callable[[JobRecord], bool]:
    """Mid-work: at least `at_least` of the job's units are done, and not all of them."""
    return lambda r: r.state == "running" and at_least <= r.progress.done < r.progress.total


def _then(mid_work: Callable[[JobRecord], bool], seconds: float) -> Callable[[JobRecord], bool]:
    """Mid-work: `seconds` after `mid_work` first held (and the job still runs)."""
    since: list[float] = []

    def later(record: JobRecord) -> bool:
        if not since and mid_work(record):
            since.append(time.monotonic())
        return bool(since) and time.monotonic() - since[0] >= seconds and record.state == "running"

    return later


def _cancelled(record: JobRecord, took: float) -> None:
    assert record.state == "cancelled", (record.state, record.error)
    assert record.error == f"job {record.id} was cancelled"
    assert took < CANCEL_S, f"cancelled {took:.1f} s after the request"


# ---------------------------------------------------------------- the signal itself


def test_check_and_progress_raise_at_once_when_stopped(tmp_path):
    reports = []
    ctx = StageContext(job_id="j", settings=Settings(workdir=tmp_path), store=None, output=None,
                       report=lambda *a: reports.append(a) or False)
    ctx.check()
    ctx.progress(1, 10)
    ctx.stop.set()
    with pytest.raises(Cancelled, match="job j was cancelled"):
        ctx.check()
    with pytest.raises(Cancelled):  # within the report's 1-s throttle: no report, but the cancel is known
        ctx.progress(2, 10)
    assert len(reports) == 1
    # a report that says the job was cancelled stops it too, and later checks know
    ctx = StageContext(job_id="j", settings=Settings(workdir=tmp_path), store=None, output=None,
                       report=lambda *a: True)
    with pytest.raises(Cancelled):
        ctx.progress(1, 10)
    assert ctx.stop.is_set()


def test_the_watch_sets_stop_within_a_second_of_the_request(runner):
    job = submit("generate", {"prompts": "bundled:sharegpt"}, runner.jobs, lambda *_: None, runner.settings)
    transition(runner.jobs, job.id, "running")
    stop = threading.Event()
    watch = CancelWatch(runner.jobs, job.id, stop, every=0.2)
    try:
        assert not stop.wait(0.5)
        asked = time.monotonic()
        request_cancel(runner.jobs, job.id)
        assert stop.wait(2.0) and time.monotonic() - asked < 1.0
    finally:
        watch.close()
    assert not watch._thread.is_alive()


def test_torchrun_ranks_stop_on_a_cancel_while_printing_nothing(tmp_path, monkeypatch):
    """run_ranks checks for a cancel while no line comes: a rank that prints nothing is stopped within a second."""
    from eyas.ranks import run_ranks

    (tmp_path / "eyas_quiet_rank.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    stop, started = threading.Event(), threading.Event()

    def check() -> None:
        if stop.is_set():
            raise Cancelled("cancelled")

    def on_line(line: str) -> bool:
        if line.startswith("started"):
            started.set()
            threading.Timer(0.5, stop.set).start()
            return True
        return False

    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        run_ranks("eyas_quiet_rank", 1, [], on_line, "quiet ranks", check=check)
    assert started.is_set() and time.monotonic() - t0 < 120


# ---------------------------------------------------------------- generate: between decoding steps


def test_in_process_engine_stops_a_batch_between_decoding_steps():
    from services.generator.engine import InProcessEngine

    steps = []

    def check() -> None:
        steps.append(1)
        if len(steps) > 3:  # the first prefill group and two decoding steps, then a cancel
            raise Cancelled("cancelled")

    engine = InProcessEngine(BUNDLED, max_batch=2, check=check)
    params = SamplingParams(max_tokens=200)
    texts = [engine.render([{"role": "user", "content": q}], params)
             for q in ("Tell me a long story.", "Count to one hundred.")]
    with pytest.raises(Cancelled):
        engine.generate_texts(texts, params)
    assert len(steps) == 4


def test_a_cancelled_generation_journals_the_samples_it_finished(tmp_path):
    """Samples finished but not yet flushed (the journal commits every checkpoint_every samples or 5 s) are
    committed when a cancel stops the run: a rerun does not generate them again."""
    from eyas.coordination import LocalLimit, local_share
    from eyas.prompts import Prompt
    from eyas.store import Artifact, LocalStore
    from services.generator.engine import Completion
    from services.generator.generate import Generator
    from services.generator.spec import Spec
    from services.generator.throttle import Throttle

    class Engine:  # answers the first request, and is cancelled in the second
        answered = 0

        async def chat(self, messages, params, timeout_s=None):
            del messages, params, timeout_s
            if self.answered:
                raise Cancelled("cancelled")
            self.answered += 1
            return Completion(content="an answer", reasoning_content=None, finish_reason="stop", prompt_tokens=3,
                              completion_tokens=2)

    spec = Spec(prompts="bundled:sharegpt", concurrency=1)
    out = Artifact(LocalStore(tmp_path / "out"))
    journal = Journal(out, flush_every=100, flush_s=3600)
    ctx = StageContext(job_id="j", settings=Settings(workdir=tmp_path), store=out.store, output=out)
    prompts = {f"p{i}": Prompt(id=f"p{i}", user_turns=[f"question {i}"]) for i in range(3)}
    generator = Generator(spec, Engine(), Throttle(LocalLimit(1, initial=1), 1), journal, ctx)
    with pytest.raises(Cancelled):
        asyncio.run(generator.run(prompts, local_share(list(prompts))))
    assert list(Journal(out).load()) == ["p0"]


def test_generate_cancelled_mid_answer_keeps_whole_samples_that_a_rerun_resumes(runner, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Write a long story about a {w} and a river."}]}) + "\n"
        for i, w in enumerate(["fox", "owl", "bee", "cat"])))
    spec = {"prompts": str(prompts), "held_out": None, "max_turns": 1, "concurrency": 1, "checkpoint_every": 100,
            "sampling": {"max_tokens": 32, "temperature": 0.0}}
    # the first prompt answered, the next one decoding: cancelled within a decoding step, not at its answer's end
    record, took = _cancel_mid_work(runner, "generate", spec, _then(_reported(1), 1.0))
    _cancelled(record, took)
    out = job_output(runner.store, record)
    assert not out.exists("manifest.json")
    # the samples finished before the cancel were journaled (the journal's buffer held them: flushed on the
    # cancel), each whole and once
    done = Journal(out).load()
    assert 1 <= len(done) < 4 and set(done) <= {f"prompts:p{i}" for i in range(4)}
    assert all(len(r["turns"]) == 1 and r["messages"][-1]["role"] == "assistant" for r in done.values())
    # a rerun of the job (a worker picking it up again) resumes from them: none generated again, none lost
    from services.generator.core import Spec, run

    ctx = StageContext(job_id=record.id, settings=runner.settings, store=runner.store, output=out)
    result = run(Spec.model_validate(record.spec), ctx)
    assert result.metrics["resumed"] == len(done) and result.metrics["completed"] == 4
    records = [json.loads(line) for name in sorted(out.names()) if name.startswith("conversations-")
               for line in out.get_bytes(name).decode().splitlines()]
    assert len({r["id"] for r in records}) == len(records) == 4
    assert all(r == done[r["id"]] for r in records if r["id"] in done)


def test_generate_on_an_endpoint_lets_its_requests_in_flight_go(runner, tmp_path):
    """Against a server whose answers take many seconds, a cancel does not wait for them: the requests in flight
    are let go (the server sees its clients hang up)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(4)))
    fake = FakeLLM(slots=4, token_s=0.5)  # an answer of the 4 takes 8 s or more
    with fake as url:
        spec = {"prompts": str(prompts), "held_out": None, "endpoint": url, "concurrency": 4,
                "sampling": {"max_tokens": 200}}
        record, took = _cancel_mid_work(runner, "generate", spec,
                                        _then(lambda _: fake.stats["first_request"] is not None, 1.0))
        _cancelled(record, took)
        assert fake.stats["answers"] == 0 and fake.stats["aborted"] >= 1
    assert not job_output(runner.store, record).exists("manifest.json")


# ---------------------------------------------------------------- extract: between forward batches


def test_extract_cancelled_between_forward_batches_leaves_whole_shards_and_no_manifest(runner, tmp_path):
    data = write_records(tmp_path / "data", _conversations(240))
    spec = {"data": data, "batch_tokens": 256, "shard_mb": 1}  # about a shard a forward batch
    record, took = _cancel_mid_work(runner, "extract", spec, _reported(1000))
    _cancelled(record, took)
    out = job_output(runner.store, record)
    assert not out.exists("manifest.json")
    # a shard is uploaded whole or not at all: every one there loads (a rerun writes them all again)
    shards = [name for name in out.names() if name.endswith(".safetensors")]
    assert shards
    for name in shards:
        path = tmp_path / "shard.safetensors"
        path.write_bytes(out.get_bytes(name))
        assert load_file(str(path))


def test_extract_at_the_default_batch_stops_mid_forward(runner, tmp_path):
    """At the default batch_tokens (8,192) one forward takes many seconds on a CPU (18 s on 2 cores): a cancel that
    comes as the second batch starts stops it between two of its decoder layers, not at its end."""
    from services.extractor.spec import Spec

    data = write_records(tmp_path / "data", _conversations(600))  # ~50 tokens a sample: 3 or 4 batches
    first = Spec.model_fields["batch_tokens"].default  # the spec below leaves it unset
    record, took = _cancel_mid_work(runner, "extract", {"data": data}, _reported(1))
    _cancelled(record, took)
    assert 0 < record.progress.done <= first < record.progress.total  # it was cancelled in the second forward
    assert not job_output(runner.store, record).exists("manifest.json")


@pytest.mark.vllm
def test_extract_on_the_vllm_engine_stops_within_seconds(runner, tmp_path):
    """The default engine where vLLM's environment is installed: the job's side notices the cancel while it waits
    for the engine's next line, and stops the engine (the next job starts a fresh one)."""
    from services.extractor import vllm_backend

    data = write_records(tmp_path / "data", _conversations(600))
    record, took = _cancel_mid_work(runner, "extract", {"data": data, "engine": "vllm", "batch_tokens": 1024},
                                    _reported(1))
    _cancelled(record, took)
    assert vllm_backend._engine is None  # stopped with the job
    assert not job_output(runner.store, record).exists("manifest.json")


# ---------------------------------------------------------------- train: between training steps


def test_train_cancelled_between_steps_keeps_its_checkpoint(runner, features):
    spec = {"features": features, **CPU_PRESET, "batch_tokens": 256, "steps": 100_000, "warmup": 1,
            "val_every": 4, "val_interval": 0, "checkpoint_every": 2}
    record, took = _cancel_mid_work(runner, "train", spec, _reported(3))
    _cancelled(record, took)
    out = job_output(runner.store, record)
    assert not out.exists("manifest.json")
    # what it trained is resumable: a whole checkpoint, from which a rerun continues
    _, _, state = load_checkpoint(out)
    assert 2 <= state["step"] < 100_000


# ---------------------------------------------------------------- evaluate: between decoding steps


def test_evaluate_cancelled_mid_greedy_decoding_writes_no_report(runner, drafter, monkeypatch):
    from services.evaluator import core

    decoding = threading.Event()
    greedy = core.greedy

    def noted(*args, **kwargs):
        decoding.set()
        return greedy(*args, **kwargs)

    monkeypatch.setattr(core, "greedy", noted)
    spec = {"drafter": drafter, "num_prompts": 4, "max_new_tokens": 256, "second_prompts": None,
            "decode_prompts": 1}
    mid_greedy = _then(lambda _: decoding.is_set(), 1.0)  # a second into the target's greedy decoding
    record, took = _cancel_mid_work(runner, "evaluate", spec, mid_greedy)
    _cancelled(record, took)
    out = job_output(runner.store, record)
    assert not out.exists("manifest.json") and not out.exists("report.json")


def test_evaluate_greedy_checks_between_decoding_steps():
    """The reference decoding stops within a step of a cancel (transformers' generate, through a stopping
    criterion that checks)."""
    from services.evaluator.specdec import greedy

    target = load_target(BUNDLED)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise Cancelled("cancelled")

    with pytest.raises(Cancelled):
        greedy(target, [[1, 2, 3, 4]], 50, {0}, check=check)
    assert len(calls) == 3


def test_evaluate_stops_waiting_for_the_vllm_it_starts(tmp_path):
    """The evaluator's live check starts vLLM itself (EYAS_VLLM_COMMAND), a minute or more on a CPU: a cancel
    stops the wait between two polls, and the server with it."""
    from services.evaluator import launch

    pid_file = tmp_path / "pid"
    never_ready = f"{sys.executable} -c 'import os, sys, time; open(sys.argv[1], \"w\").write(str(os.getpid())); " \
                  f"time.sleep(600)' {pid_file}"
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()

    def check() -> None:
        if stop.is_set():
            raise Cancelled("job j was cancelled")

    t0 = time.monotonic()
    with pytest.raises(Cancelled), launch.vllm(never_ready, tmp_path, check=check):
        pass
    took = time.monotonic() - t0 - 2.0
    assert took < CANCEL_S, f"stopped {took:.1f} s after the cancel"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # the server was stopped (and waited for)
        os.kill(pid, 0)

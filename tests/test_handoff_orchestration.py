"""A hand-off before a job ends: when a job's stage calls StageContext.hand_off (its spec hands off early:
eyas.stage.StageSpec.hands_off_early), the next stage of its `then` is submitted then, on its output URI, and the
embedded runner runs that job
beside it; every other job runs after the one before it, on the caller's thread. The stages here are fakes put in
the registry in place of extract, train and evaluate; they note when and on which thread they ran."""
from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from eyas.settings import Settings
from eyas.stage import StageContext, StageResult, StageSpec
from orchestration import registry
from orchestration.embedded import EmbeddedRunner

WAIT_S = 5.0  # a fake waits this long for the other side at most, so a broken runner fails instead of hanging


class FakeSpec(StageSpec):
    data: str = ""  # the input: the output of the stage before
    stream: bool = False  # hand off at the start
    fail: bool = False

    def hands_off_early(self) -> bool:
        return self.stream


@dataclass
class Seen:
    """What the fake stages did: (stage, "start" | "end", thread name) in order, and each one's input."""

    steps: list[tuple[str, str, str]] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)
    train_started: threading.Event = field(default_factory=threading.Event)
    extract_ended: threading.Event = field(default_factory=threading.Event)
    extract_failed: bool = False

    def note(self, stage: str, what: str) -> None:
        self.steps.append((stage, what, threading.current_thread().name))


def _fake_stages(seen: Seen) -> dict[str, types.ModuleType]:
    def extract(spec: FakeSpec, ctx: StageContext) -> StageResult:
        seen.note("extract", "start")
        if spec.stream:
            ctx.hand_off()  # the output is readable from here on
        try:
            # a streaming extraction waits for its reader (the real one: for its windows to be consumed)
            if spec.stream and not seen.train_started.wait(WAIT_S):
                raise TimeoutError("the train job did not start beside the extract job")
            if spec.fail:
                seen.extract_failed = True
                raise RuntimeError("extraction broke")
            return StageResult(output_uri=ctx.output.uri)
        finally:
            seen.note("extract", "end")
            seen.extract_ended.set()

    def train(spec: FakeSpec, ctx: StageContext) -> StageResult:
        seen.note("train", "start")
        seen.inputs["train"] = spec.data
        seen.train_started.set()
        if not seen.extract_ended.wait(WAIT_S):
            raise TimeoutError("the extract job did not end")
        if seen.extract_failed:  # the real trainer learns so from the store (eyas.handoff) and gives up
            raise RuntimeError("the features stream was aborted")
        seen.note("train", "end")
        return StageResult(output_uri=ctx.output.uri)

    def evaluate(spec: FakeSpec, ctx: StageContext) -> StageResult:
        seen.note("evaluate", "start")
        seen.inputs["evaluate"] = spec.data
        return StageResult(output_uri=ctx.output.uri)

    modules = {}
    for name, run in (("extract", extract), ("train", train), ("evaluate", evaluate)):
        mod = types.ModuleType(f"fake_{name}")
        mod.Spec, mod.INPUT_FIELD, mod.run = FakeSpec, "data", run
        modules[name] = mod
    return modules


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[Seen]:
    seen = Seen()
    for name, mod in _fake_stages(seen).items():
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        monkeypatch.setitem(registry._MODULES, name, mod.__name__)
    registry.step_model.cache_clear()  # `then` entries are checked against the stages' (cached) step models
    yield seen
    registry.step_model.cache_clear()


def _runner(tmp_path) -> EmbeddedRunner:
    return EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))


def test_a_job_that_hands_off_early_runs_beside_the_next_one_and_the_rest_follow(tmp_path, seen):
    runner = _runner(tmp_path)
    extract, train, evaluate = runner.run_job("extract", {"data": "in", "stream": True,
                                                          "then": [{"stage": "train", "fail": False}, "evaluate"]})

    assert [(j.stage, j.state) for j in (extract, train, evaluate)] == [
        ("extract", "succeeded"), ("train", "succeeded"), ("evaluate", "succeeded")]
    # submitted once, at the start, on the extract job's output; the end of the extract job found it there
    assert [j.id for j in runner.jobs.list(stage="train")] == [train.id] == [extract.next_job]
    assert train.parent == extract.id and train.spec["fail"] is False
    assert seen.inputs["train"] == extract.artifacts["output"]
    assert seen.inputs["evaluate"] == train.artifacts["output"]
    # train started before extraction ended, on a thread of its own; evaluate after train, on the caller's thread
    caller = threading.current_thread().name
    steps = [(stage, what) for stage, what, _ in seen.steps]
    assert steps.index(("train", "start")) < steps.index(("extract", "end"))
    assert steps[-2:] == [("train", "end"), ("evaluate", "start")]
    threads = {stage: thread for stage, _, thread in seen.steps}
    assert threads["extract"] == threads["evaluate"] == caller != threads["train"]


def test_without_a_hand_off_the_jobs_run_one_after_another_on_the_callers_thread(tmp_path, seen):
    jobs = _runner(tmp_path).run_job("extract", {"data": "in", "then": ["train", "evaluate"]})

    assert [(j.stage, j.state) for j in jobs] == [
        ("extract", "succeeded"), ("train", "succeeded"), ("evaluate", "succeeded")]
    caller = threading.current_thread().name
    assert seen.steps == [("extract", "start", caller), ("extract", "end", caller), ("train", "start", caller),
                          ("train", "end", caller), ("evaluate", "start", caller)]


def test_a_failed_job_is_raised_once_the_job_beside_it_has_ended(tmp_path, seen):
    runner = _runner(tmp_path)
    with pytest.raises(RuntimeError, match="extraction broke"):
        runner.run_job("extract", {"data": "in", "stream": True, "fail": True, "then": ["train", "evaluate"]})

    records = {j.stage: j for j in runner.jobs.list()}
    assert records.keys() == {"extract", "train"}  # nothing after a failed train
    assert records["extract"].state == records["train"].state == "failed"
    assert "extraction broke" in records["extract"].error
    assert "aborted" in records["train"].error
    assert ("train", "start") in [(stage, what) for stage, what, _ in seen.steps]


def test_a_failed_job_with_nothing_beside_it_is_raised_and_nothing_follows(tmp_path, seen):
    runner = _runner(tmp_path)
    with pytest.raises(RuntimeError, match="extraction broke"):
        runner.run_job("extract", {"data": "in", "fail": True, "then": ["train", "evaluate"]})

    assert [(j.stage, j.state) for j in runner.jobs.list()] == [("extract", "failed")]
    assert not seen.train_started.is_set()

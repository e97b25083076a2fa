"""Stages that work to deadlines (#29): the deadline logic on a fake clock (the trainer's schedule re-sized as its
step time drifts, the evaluator's cutoff, the run's re-plan), and each stage keeping to a real `finish_by`."""
from __future__ import annotations

import json
import time

import pytest

from eyas.deadline import Deadline, Pace
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.target import BUNDLED, load_tokenizer
from orchestration.budget import Done, Rates, replan, scaled, speed
from orchestration.embedded import EmbeddedRunner
from orchestration.execution import job_output
from services.evaluator.core import Cutoff, spread_order
from services.generator.generate import Generator
from services.generator.spec import Spec as GenerateSpec
from services.trainer.spec import CPU_PRESET
from services.trainer.train import _deadline_total, lr_at
from tests.datasets import CONVERSATIONS, write_records
from tests.fake_llm import FakeLLM


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_pace_follows_the_recent_units_and_a_deadline_says_what_fits():
    clock = FakeClock()
    deadline, pace = Deadline(clock.now + 10, clock), Pace(clock, window=4)
    pace.mark()
    assert not pace.known and pace.seconds() == 0.0
    for _ in range(4):
        clock.now += 1.0
        pace.mark()
    assert pace.seconds() == 1.0 and deadline.left() == 6.0
    for _ in range(4):  # the machine got busy: the window forgets the quiet units
        clock.now += 3.0
        pace.mark()
    assert pace.seconds() == 3.0 and deadline.fits(-6.0) and not deadline.fits(0.0)
    assert not Deadline(None) and Deadline(None).fits(1e12)


def _simulate(step_s, most: int, budget_s: float, val_s: float = 0.0) -> tuple[list[int], float, float]:
    """A training loop on a fake clock, as services.trainer.train runs it: each step takes step_s(step) seconds;
    returns the totals the schedule went through, the time at the end and the deadline."""
    clock = FakeClock()
    deadline, pace = Deadline(clock.now + budget_s, clock), Pace(clock)
    total, step, totals = most, 0, [most]
    pace.mark()
    while step < total:
        clock.now += step_s(step)
        step += 1
        pace.mark()
        total = _deadline_total(total, most, step, deadline, pace.seconds(), val_s)
        if total != totals[-1]:
            totals.append(total)
    return totals, clock.now + val_s, deadline.finish_by


def test_generation_starts_a_prompt_while_half_of_it_fits():
    gen = Generator(GenerateSpec(prompts="bundled:sharegpt", finish_by=time.time() + 30.0), None, None, None, None)
    assert not gen._past_deadline()  # nothing measured yet: the first prompt always starts
    gen.pace.add(50.0)  # a unit of 50 s: 25 of them fit in the 30 s left
    assert not gen._past_deadline()
    gen.pace.add(90.0)  # now 70 s a unit: 35 do not
    assert gen._past_deadline() and gen.stopped_at_deadline
    assert not Generator(GenerateSpec(prompts="bundled:sharegpt"), None, None, None, None)._past_deadline()


def test_the_schedule_is_sized_to_the_steps_that_fit_and_resized_when_the_step_time_drifts():
    # 1 s a step, 100 s: about 100 steps of the 10,000 asked, ending by the deadline
    totals, ended, finish_by = _simulate(lambda step: 1.0, 10_000, 100.0)
    assert 90 <= totals[-1] <= 98 and ended <= finish_by
    assert totals[1] == totals[-1]  # a steady machine: sized once
    # busy from step 20 on (3 s a step): re-sized down, still ends by the deadline
    totals, ended, finish_by = _simulate(lambda step: 1.0 if step < 20 else 3.0, 10_000, 100.0)
    assert totals[1] > totals[-1] >= 40 and ended <= finish_by + 3.0
    # quiet after a busy start: re-sized up
    totals, ended, finish_by = _simulate(lambda step: 3.0 if step < 10 else 1.0, 10_000, 200.0)
    assert totals[-1] > totals[1] and ended <= finish_by
    # never more than asked, whatever time is left
    totals, ended, _ = _simulate(lambda step: 1.0, 50, 1000.0)
    assert totals == [50] and ended == 1050.0
    # the last validation's time is kept: validating takes 10 s, so about 10 fewer steps
    assert _simulate(lambda step: 1.0, 10_000, 100.0, val_s=10.0)[0][-1] <= 88


def test_the_learning_rate_ends_at_zero_where_the_deadline_stops():
    totals, _, _ = _simulate(lambda step: 1.0 if step < 20 else 2.0, 10_000, 100.0)
    assert lr_at(totals[-1], totals[-1], 10, 3e-3) == 0.0 and lr_at(totals[-1] // 2, totals[-1], 10, 3e-3) > 1e-3


def test_the_evaluators_prefixes_are_spread_and_its_cutoff_keeps_the_floor():
    order = spread_order(80)
    assert sorted(order) == list(range(80))
    # MT-bench's 80: ten per category in file order; any prefix of 16 covers all 8 categories
    assert {i // 10 for i in order[:16]} == set(range(8)) and {i // 10 for i in order[:8]} == set(range(8))
    clock = FakeClock()
    cutoff = Cutoff(Deadline(clock.now + 100, clock), floor=16, after_prompts=6, after_s=25.0)
    assert cutoff.another(0, 16, prompt_s=100.0)  # below the floor: always
    assert cutoff.another(16, 16, prompt_s=3.0)  # 22 prompts × 3 s + 25 s ≤ 100 s
    assert not cutoff.another(16, 16, prompt_s=4.0)


QUIET = Rates(decode_tok_s=270.0, decode_half_tok_s=190.0, forward_tok_s=2500.0, train_tok_s=700.0,
              val_tok_s=2100.0, step_s=0.02)


def test_a_replan_gives_training_what_extraction_and_evaluation_leave():
    done = Done(samples=300, tokens=300 * 140)
    quiet = replan(400.0, QUIET, done, 20, 96, ("extract", "train", "evaluate"))
    assert sum(quiet.values()) == pytest.approx(400.0) and quiet["train"] > 100
    busy = replan(400.0, scaled(QUIET, 0.5), done, 20, 96, ("extract", "train", "evaluate"))
    assert (busy["extract"] > quiet["extract"] and busy["evaluate"] > quiet["evaluate"]
            and busy["train"] < quiet["train"])
    streamed = replan(400.0, QUIET, done, 20, 96, ("extract", "train", "evaluate"), overlap=True)
    assert streamed["extract"] == 0.0 and streamed["train"] > quiet["train"]
    # too little left: the shares shrink to fit it, training keeps some
    tight = replan(30.0, scaled(QUIET, 0.1), done, 20, 96, ("train", "evaluate"))
    assert sum(tight.values()) <= 30.0 + 1e-9 and tight["train"] > 0
    # a stage ran long (measured: extraction at 2/3 of the speed generation read left training 13 s, one step of
    # 278): training keeps the share the plan first gave it, evaluation shrinks into the rest, and only that floor
    # plans past what is left
    late = replan(104.0, scaled(QUIET, 0.1), done, 20, 96, ("train", "evaluate"), train_floor_s=58.0)
    assert late["train"] == 58.0 and late["evaluate"] == pytest.approx(104.0 - 58.0)
    assert replan(400.0, QUIET, done, 20, 96, ("extract", "train", "evaluate"), train_floor_s=58.0) == quiet
    spent = replan(40.0, QUIET, done, 20, 96, ("extract", "train", "evaluate"), train_floor_s=58.0)
    assert spent == {"extract": 0.0, "train": 58.0, "evaluate": 0.0}
    assert speed(100.0, 50.0) == 2.0 and speed(1.0, 1e6) == 1 / 8  # twice the probe's rates; a floor


# ---------------------------------------------------------------- the stages, on the real clock


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> EmbeddedRunner:
    load_tokenizer(BUNDLED)  # converts the bundled target on first use: not inside a timed job's deadline
    return EmbeddedRunner(Settings(workdir=tmp_path_factory.mktemp("deadline"),
                                   input_roots=[tmp_path_factory.getbasetemp()]))


def test_generation_stops_taking_prompts_it_cannot_finish_and_keeps_whole_ones(runner, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(400)))
    with FakeLLM(slots=4, token_s=0.004) as url:  # answers of ~0.1-0.5 s, 4 at a time: 400 take ~30 s
        t0 = time.time()
        spec = {"prompts": str(prompts), "held_out": None, "endpoint": url, "concurrency": 4,
                "sampling": {"max_tokens": 100}, "finish_by": t0 + 3.0}
        [job] = runner.run_job("generate", spec)
        took = time.time() - t0
    assert job.state == "succeeded", job.error
    m = job.metrics
    assert 4 <= m["completed"] < 400 and m["unreached"] == 400 - m["completed"] - m["failed"] > 0
    # the deadline, the answers in flight, the artifact; all 400 would take ~30 s (the bound is loose: a loaded CI
    # host is slow to load the tokenizer and write the shards, and `completed < 400` already shows the stop)
    assert took < 3.0 + 12.0, took
    out = job_output(runner.store, job)
    records = [json.loads(line) for name in sorted(out.names()) if name.startswith("conversations-")
               for line in out.get_bytes(name).decode().splitlines()]
    assert len(records) == m["completed"] and all(r["messages"][-1]["role"] == "assistant" for r in records)


def test_synthesizing_generation_answers_each_batch_before_drawing_the_next(runner):
    # a deadline far off, so the outcome does not depend on this host's speed: two batches of 2, each drawn (rounds
    # of 2 candidates) and answered in turn; when a batch is drawn near the deadline, and that its answers come
    # before the next draw, is tested in test_synthesis on a scripted engine
    spec = {"synthesize": 4, "held_out": None, "concurrency": 2, "sampling": {"max_tokens": 8},
            "finish_by": time.time() + 900.0}
    [job] = runner.run_job("generate", spec)
    assert job.state == "succeeded", job.error
    m, counts = job.metrics, read_manifest(job_output(runner.store, job)).counts
    assert m["completed"] == counts["prompts"] == counts["source:synth"] == 4 and m["unreached"] == 0, (m, counts)
    # two batches drawn (a batch is at most `concurrency` prompts: 2 and 2), each in its own rounds
    assert counts["drawn_batches"] == 2 and counts["synth_rounds"] >= 2, counts


def test_synthesis_that_keeps_no_prompt_before_its_deadline_fails_saying_so(runner):
    with pytest.raises(RuntimeError, match="no prompt was synthesized before the deadline"):
        runner.run_job("generate", {"synthesize": 4, "held_out": None, "concurrency": 2,
                                    "sampling": {"max_tokens": 8}, "finish_by": time.time()})
    assert any("no prompt was synthesized before the deadline" in (j.error or "")
               for j in runner.jobs.list(stage="generate", state="failed"))  # the record says why


@pytest.fixture(scope="module")
def features(runner, tmp_path_factory) -> str:
    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"{q} (#{i})"},
                                                  {"role": "assistant", "content": a}]}
                     for i, (q, a) in enumerate(CONVERSATIONS[i % len(CONVERSATIONS)] for i in range(24))]
    [job] = runner.run_job("extract", {"data": write_records(tmp_path_factory.mktemp("data") / "d", conversations)})
    assert job.state == "succeeded", job.error
    return job.artifacts["output"]


def test_training_stops_at_its_deadline_with_its_schedule_run_out_and_exports(runner, features):
    t0 = time.time()
    spec = {"features": features, **CPU_PRESET, "batch_tokens": 256, "epochs": 1000.0, "warmup": 1,
            "val_every": 4, "val_interval": 0, "finish_by": t0 + 20.0}  # (loading takes some)
    [job] = runner.run_job("train", spec)
    took = time.time() - t0
    assert job.state == "succeeded", job.error
    history = json.loads(job_output(runner.store, job).get_bytes("history.json"))
    steps = len(history["train"])
    assert 2 <= steps < 1000 and took < 20.0 + 8.0, (steps, took)  # (the exports follow the deadline)
    # the schedule was sized to the steps that fit (1,000 epochs' cosine would still be at its peak)
    assert history["train"][-1]["lr"] < 0.95 * CPU_PRESET["lr"]
    assert history["val"][-1]["step"] == steps  # and validated there


def test_evaluation_scores_a_spread_batch_at_least_and_says_how_many(runner, features):
    [trained] = runner.run_job("train", {"features": features, **CPU_PRESET, "steps": 2, "warmup": 1,
                                         "val_every": 4, "val_interval": 0})
    spec = {"drafter": trained.artifacts["output"], "num_prompts": 80, "min_prompts": 2, "max_new_tokens": 8,
            "second_prompts": None, "decode_prompts": 1, "finish_by": time.time()}  # past at the first batch
    [job] = runner.run_job("evaluate", spec)
    assert job.state == "succeeded", job.error
    assert job.metrics["prompts"] == 16  # one batch: the floor is inside it, the deadline stops the next
    report = json.loads(job_output(runner.store, job).get_bytes("report.json"))
    assert len(report["acceptance"]["per_category"]) == 8  # a prefix spread over MT-bench's categories


def test_a_probe_that_read_a_busy_machine_does_not_give_evaluation_the_budget():
    from orchestration.budget import EVAL_SHARE, first_shares, plan_run

    quiet = first_shares(plan_run(10, QUIET, 96).seconds)
    busy = first_shares(plan_run(10, scaled(QUIET, 0.25), 96).seconds)
    assert quiet["evaluate"] <= EVAL_SHARE and sum(quiet.values()) == pytest.approx(1.0)
    assert busy["evaluate"] == pytest.approx(EVAL_SHARE) and sum(busy.values()) == pytest.approx(1.0)
    assert busy["generate"] > 0.8 * quiet["generate"]  # generation, where τ is bought, keeps most of its share


def test_the_probe_keeps_each_rates_fastest_reading_so_a_hog_in_one_reading_does_not_set_the_shares():
    from dataclasses import replace

    from orchestration.budget import first_shares, plan_run
    from orchestration.machine_rate import fastest

    # a hog that ended during the first reading's decoding: only that rate read 4x slow (measured: 42 tok/s, 184 quiet)
    hogged = replace(QUIET, decode_tok_s=QUIET.decode_tok_s / 4, decode_half_tok_s=QUIET.decode_half_tok_s / 4)
    later = scaled(QUIET, 0.9)
    rates = fastest([hogged, later])
    assert rates == replace(later, forward_tok_s=QUIET.forward_tok_s, train_tok_s=QUIET.train_tok_s,
                            val_tok_s=QUIET.val_tok_s, step_s=QUIET.step_s)
    quiet = first_shares(plan_run(10, QUIET, 96).seconds)["generate"]
    assert first_shares(plan_run(10, hogged, 96).seconds)["generate"] > quiet + 0.15  # one reading: training starves
    assert first_shares(plan_run(10, rates, 96).seconds)["generate"] == pytest.approx(quiet, abs=0.03)

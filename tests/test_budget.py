"""`eyas run --minutes N`: the plan fits the budget with the rates it is given, grows with the budget, runs its
prompts in balanced in-process batches, and below one batch shortens the run rather than overrunning it."""
from __future__ import annotations

import dataclasses
import math

import pytest

from eyas.layout import default_aux_layers
from orchestration.budget import (
    MAX_EPOCHS,
    VAL_PASSES,
    Rates,
    batches,
    features_gb,
    features_policy,
    plan_run,
    sample_tokens,
    stage_seconds,
    train_steps,
    val_interval,
    val_passes,
)
from orchestration.live_plan import LivePlan, live_plan
from orchestration.run_command import apply_overrides, hand_off_features
from services.trainer.spec import Spec as TrainSpec

# about what a quiet 2-core machine measures with the bundled target
QUIET = Rates(decode_tok_s=270.0, decode_half_tok_s=190.0, forward_tok_s=2500.0, train_tok_s=700.0,
              val_tok_s=2100.0, step_s=0.02)
BATCH = 96


@pytest.mark.parametrize("minutes", [3, 10, 30, 60])
def test_the_plan_fits_the_budget(minutes):
    plan = plan_run(minutes, QUIET, batch=BATCH)
    assert sum(plan.seconds.values()) <= minutes * 60
    assert plan.num_prompts >= 8 and plan.eval_prompts >= 4


def test_more_minutes_buy_more_prompts_and_more_evaluation():
    plans = [plan_run(m, QUIET, batch=BATCH) for m in (10, 30, 60)]
    assert [p.num_prompts for p in plans] == sorted({p.num_prompts for p in plans})  # strictly more
    assert all(p.num_prompts % 8 == 0 and p.max_tokens == 96 for p in plans)
    assert plans[0].eval_prompts == 20 and plans[0].eval_prompts < plans[1].eval_prompts < plans[2].eval_prompts
    for minutes, plan in zip((10, 30, 60), plans, strict=True):  # 8 more prompts would not have fitted
        more = stage_seconds(QUIET, plan.num_prompts + 8, plan.max_tokens, plan.eval_prompts, BATCH)
        assert sum(more.values()) > minutes * 60


def test_prompts_run_in_the_fewest_balanced_batches_and_a_part_batch_costs_its_steps():
    assert batches(96, 96) == [96] and batches(200, 96) == [67, 67, 66] and batches(40, 96) == [40]
    assert all(sum(batches(n, 96)) == n and max(batches(n, 96)) <= 96 for n in range(1, 500))
    generate = [stage_seconds(QUIET, n, 96, 20, BATCH)["generate"] for n in (48, 96, 97, 192)]
    assert generate == sorted(generate)
    # one row past a batch adds a second batch's steps: much more than a row's share, less than a whole batch
    assert 2 * (generate[1] - generate[0]) > generate[2] - generate[1] > (generate[1] - generate[0]) / 48


def test_prompts_are_sized_for_the_most_epochs_training_runs():
    # training's share holds MAX_EPOCHS over the planned prompts: generation that outruns its probe leaves epochs
    for minutes in (10, 30, 60):
        plan = plan_run(minutes, QUIET, batch=BATCH)
        at_max = stage_seconds(QUIET, plan.num_prompts, plan.max_tokens, plan.eval_prompts, BATCH, MAX_EPOCHS)
        assert plan.seconds == at_max and f"{MAX_EPOCHS:g} epochs" in plan.describe()
        # sized at half the epochs, more prompts would have fitted: the epochs, not the prompts, bound the plan
        half = stage_seconds(QUIET, plan.num_prompts + 8, plan.max_tokens, plan.eval_prompts, BATCH, MAX_EPOCHS / 2)
        assert sum(half.values()) <= minutes * 60


def test_answers_too_long_for_one_batch_are_shortened():
    plan = plan_run(10, QUIET, batch=BATCH, max_tokens=4000)
    assert 64 <= plan.max_tokens < 4000 and sum(plan.seconds.values()) <= 10 * 60
    longer = stage_seconds(QUIET, BATCH, plan.max_tokens + 16, plan.eval_prompts, BATCH)
    assert plan.max_tokens == 64 or sum(longer.values()) > 10 * 60  # 16 tokens more and one batch would not fit


def test_a_slow_machine_gets_fewer_prompts_and_shorter_answers_not_an_overrun():
    slow = Rates(decode_tok_s=12.0, decode_half_tok_s=8.0, forward_tok_s=400.0, train_tok_s=100.0,
                 val_tok_s=300.0, step_s=0.05)
    plan = plan_run(5, slow, batch=48)
    assert plan.num_prompts < 48 and plan.max_tokens < 192
    assert sum(plan.seconds.values()) <= 5 * 60 or plan.num_prompts == 8  # the floor: something still trains


def test_long_runs_validate_about_val_passes_times_and_validation_is_planned():
    # short runs keep the trainer's interval (100 steps); long ones stretch it to about VAL_PASSES validations
    assert val_interval(train_steps(200, 96, 3.0)) == 100
    for prompts in (2000, 20000):
        steps = train_steps(prompts, 96, 3.0)
        assert val_passes(steps) == 1 + math.ceil(steps / val_interval(steps)) <= VAL_PASSES + 1
    # validation is in the train stage's time: slower validation, fewer prompts for the same budget
    slow_val = dataclasses.replace(QUIET, val_tok_s=QUIET.val_tok_s / 4)
    assert plan_run(60, slow_val, batch=BATCH).num_prompts < plan_run(60, QUIET, batch=BATCH).num_prompts


def test_set_overrides_reach_the_stage_specs_and_a_bad_one_is_named():
    specs = {"generate": {"sampling": {"max_tokens": 192}}, "train": {"lr": 3e-3}, "evaluate": {}}
    apply_overrides(specs, ["train.lr=0.001", "generate.sampling.temperature=0.7", "evaluate.prompts=bundled:sharegpt"])
    assert specs == {"generate": {"sampling": {"max_tokens": 192, "temperature": 0.7}}, "train": {"lr": 0.001},
                     "evaluate": {"prompts": "bundled:sharegpt"}}
    with pytest.raises(SystemExit, match="'trian.lr=1'"):
        apply_overrides(specs, ["trian.lr=1"])


def test_planned_features_take_what_a_shard_stores_per_token():
    hidden = 576  # the bundled target's width
    n_aux = len(default_aux_layers(30))  # the extractor's default for the bundled target's 30 layers
    per_token = (n_aux + 1) * hidden * 2 + 5  # bf16 aux and final states, int32 id, uint8 mask
    assert features_gb(1000, 96, hidden, n_aux) == pytest.approx(1000 * sample_tokens(96) * per_token / (1 << 30),
                                                                 rel=1e-6)
    assert features_gb(1000, 96, hidden, n_aux=5) > features_gb(1000, 96, hidden, n_aux)
    fp8_per_token = (n_aux + 1) * (hidden + 4) + 5  # e4m3 values and a float32 scale per state
    assert features_gb(1000, 96, hidden, n_aux, "float8_e4m3fn") == pytest.approx(
        1000 * sample_tokens(96) * fp8_per_token / (1 << 30), rel=1e-6)


def test_features_are_cached_when_they_fit_the_store_else_recomputed_unless_a_policy_is_asked_for():
    assert features_policy("auto", planned_gb=3.0, cap_gb=4.0)[0] == "cache"
    policy, why = features_policy("auto", planned_gb=16.0, cap_gb=4.0)
    assert policy == "recompute" and "16.00 GB" in why and "4.00 GB" in why
    assert features_policy("first_epoch", planned_gb=16.0, cap_gb=4.0)[0] == "first_epoch"
    assert features_policy("cache", planned_gb=16.0, cap_gb=4.0)[0] == "cache"
    assert features_policy("recompute", planned_gb=1.0, cap_gb=4.0)[0] == "recompute"


def test_a_streaming_policy_reaches_the_extract_and_train_specs():
    extract, train = {"stage": "extract"}, {"stage": "train", "epochs": 3.4}
    hand_off_features(extract, train, "cache", 4.0)
    assert extract == {"stage": "extract"} and train == {"stage": "train", "epochs": 3.4}

    hand_off_features(extract, train, "recompute", 4.0)
    assert extract["stream"] == {"policy": "recompute", "epochs": 4, "seed": 0, "max_store_gb": 4.0}
    assert train["cache_gb"] == TrainSpec.model_fields["cache_gb"].default  # the default already holds 2 windows
    assert extract["shard_mb"] == 256  # a quarter of the cap is more than the default
    small = {}
    hand_off_features(small, {"epochs": 1.0}, "recompute", 0.1)
    assert small["shard_mb"] == 25  # a window of half the cap holds two shards

    extract, train = {}, {"epochs": 2.0, "seed": 7}
    hand_off_features(extract, train, "first_epoch", 1000.0)
    assert extract["stream"] == {"policy": "first_epoch", "epochs": 2, "seed": 7, "max_store_gb": 1000.0}
    assert train["cache_gb"] == 1000.0  # two windows of half the cap


def test_the_live_check_is_on_where_vllm_is_installed_and_the_budget_has_room(tmp_path):
    """--live auto: on with a vLLM environment from a budget of LIVE_MIN_BUDGET times the check's reserve (fp32 and
    eager on a CPU): at concurrency 1 on the default 10 minutes, at 1 and 4 from LIVE_TWO_CONCURRENCIES_MINUTES; off
    without vLLM, on a shorter budget, or for --method auto; --live on without vLLM is an error naming it."""
    from eyas.settings import Settings
    from orchestration.live_plan import LIVE_CHECK_S, LIVE_MIN_BUDGET, LIVE_TWO_CONCURRENCIES_MINUTES

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    cpu = Settings(vllm_python=python, device="cpu")
    ten = live_plan("auto", cpu, 10, "eagle3")  # make run's budget
    assert ten.command is not None and ten.command.split()[1:5] == ["VLLM_CPU_KVCACHE_SPACE=2", str(python), "-m",
                                                                    "vllm.entrypoints.openai.api_server"]
    assert "--dtype float32 --enforce-eager" in ten.command
    assert (ten.concurrencies, ten.reserve_s) == ((1,), LIVE_CHECK_S[(1,)])
    long = live_plan("auto", cpu, LIVE_TWO_CONCURRENCIES_MINUTES, "eagle3")
    assert (long.command, long.concurrencies, long.reserve_s) == (ten.command, (1, 4), LIVE_CHECK_S[(1, 4)])
    short = live_plan("auto", cpu, LIVE_MIN_BUDGET * LIVE_CHECK_S[(1,)] / 60 - 0.1, "eagle3")
    assert (short.command, short.reserve_s) == (None, 0.0) and "auto needs 10 minutes" in short.why
    assert live_plan("on", cpu, 1, "eagle3").command == ten.command
    assert live_plan("off", cpu, 30, "eagle3") == LivePlan(None, (1, 4), 0.0, "--live off")
    assert live_plan("auto", cpu, 30, "auto").command is None
    operator = Settings(vllm_python=python, vllm_command="my-vllm --dtype half")
    assert live_plan("auto", operator, 30, "eagle3").command == "my-vllm --dtype half"
    missing = Settings(vllm_python=tmp_path / "none" / "python")
    assert live_plan("auto", missing, 30, "eagle3").why == "no vLLM environment installed (scripts/install-vllm.sh)"
    with pytest.raises(SystemExit, match="--live on: no vLLM environment"):
        live_plan("on", missing, 10, "eagle3")

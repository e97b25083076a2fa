"""`eyas run --minutes N`: the plan fits the budget with the rates it is given, grows with the budget in whole
in-process batches, and below one batch shortens the run rather than overrunning it."""
from __future__ import annotations

import pytest

from orchestration.budget import EPOCHS, MAX_EPOCHS, Rates, plan_run, stage_seconds
from orchestration.run_command import apply_overrides

# about what a quiet 2-core machine measures with the bundled target
QUIET = Rates(decode_tok_s=120.0, forward_tok_s=2500.0, train_tok_s=700.0, step_s=0.02)


@pytest.mark.parametrize("minutes", [3, 10, 30, 60])
def test_the_plan_fits_the_budget(minutes):
    plan = plan_run(minutes, QUIET, batch=48)
    assert sum(plan.seconds.values()) <= minutes * 60
    assert plan.num_prompts >= 8 and plan.eval_prompts >= 4


def test_more_minutes_buy_more_prompts_in_whole_batches_and_more_evaluation():
    plans = [plan_run(m, QUIET, batch=48) for m in (10, 30, 60)]
    assert [p.num_prompts for p in plans] == sorted({p.num_prompts for p in plans})  # strictly more
    assert all(p.num_prompts % 48 == 0 and p.max_tokens == 96 for p in plans)
    assert plans[0].eval_prompts == 20 and plans[0].eval_prompts < plans[1].eval_prompts < plans[2].eval_prompts
    for minutes, plan in zip((10, 30, 60), plans, strict=True):  # one more batch would not have fitted
        more = stage_seconds(QUIET, plan.num_prompts + 48, plan.max_tokens, plan.eval_prompts)
        assert sum(more.values()) > minutes * 60


def test_the_time_whole_batches_leave_buys_epochs_up_to_the_cap():
    for minutes in (10, 30, 60):
        plan = plan_run(minutes, QUIET, batch=48)
        assert EPOCHS <= plan.epochs <= MAX_EPOCHS and sum(plan.seconds.values()) <= minutes * 60
        if plan.epochs < MAX_EPOCHS:  # a tenth of an epoch more would not have fitted
            more = stage_seconds(QUIET, plan.num_prompts, plan.max_tokens, plan.eval_prompts, plan.epochs + 0.1)
            assert sum(more.values()) > minutes * 60
    tight = plan_run(10, QUIET, batch=48, max_tokens=4000)  # under one batch: prompts fill the budget to within one
    assert EPOCHS <= tight.epochs < EPOCHS + 1
    more = stage_seconds(QUIET, tight.num_prompts, tight.max_tokens, tight.eval_prompts, tight.epochs + 0.1)
    assert sum(more.values()) > 10 * 60


def test_a_slow_machine_gets_fewer_prompts_and_shorter_answers_not_an_overrun():
    slow = Rates(decode_tok_s=12.0, forward_tok_s=400.0, train_tok_s=100.0, step_s=0.05)
    plan = plan_run(5, slow, batch=48)
    assert plan.num_prompts < 48 and plan.max_tokens < 192
    assert sum(plan.seconds.values()) <= 5 * 60 or plan.num_prompts == 8  # the floor: something still trains


def test_set_overrides_reach_the_stage_specs_and_a_bad_one_is_named():
    specs = {"generate": {"sampling": {"max_tokens": 192}}, "train": {"lr": 3e-3}, "evaluate": {}}
    apply_overrides(specs, ["train.lr=0.001", "generate.sampling.temperature=0.7", "evaluate.prompts=bundled:sharegpt"])
    assert specs == {"generate": {"sampling": {"max_tokens": 192, "temperature": 0.7}}, "train": {"lr": 0.001},
                     "evaluate": {"prompts": "bundled:sharegpt"}}
    with pytest.raises(SystemExit, match="'trian.lr=1'"):
        apply_overrides(specs, ["trian.lr=1"])

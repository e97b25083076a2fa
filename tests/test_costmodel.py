"""The serving cost model and recommendation (services/evaluator/costmodel.py) on made-up step times, the replay of
K-chains over run lengths (services/evaluator/chains.py; checked against real decoding in
tests/test_vllm_spec_decode.py), and a vLLM command that does not serve (services/evaluator/launch.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from services.evaluator.chains import chain_acceptance
from services.evaluator.costmodel import StepTimes, decision, interpolate, recommend, speculative_config
from services.evaluator.launch import vllm

# A memory-bound engine up to 32 tokens a step (10 ms whatever the batch), compute-bound beyond (linear); a drafter
# step costs 1 ms at any batch.
ENGINE = StepTimes(target=[(1, 0.010), (32, 0.010), (64, 0.020), (128, 0.040)], drafter=[(1, 0.001), (64, 0.001)])
GOOD = {1: 1.8, 2: 2.4, 3: 2.7}  # τ(K) of a drafter that accepts a lot
BAD = {1: 1.02, 2: 1.03, 3: 1.03}


def test_interpolate_is_piecewise_linear_and_extends_the_outer_segments():
    pts = [(1, 1.0), (3, 3.0), (5, 4.0)]
    assert interpolate(pts, 2) == pytest.approx(2.0)
    assert interpolate(pts, 4) == pytest.approx(3.5)
    assert interpolate(pts, 9) == pytest.approx(6.0)  # the last segment, continued
    assert interpolate(pts, 0) == pytest.approx(0.0)  # the first, continued (and never below 0)
    assert interpolate([(8, 2.0)], 100) == 2.0


def test_tokens_per_second_with_and_without_speculation():
    assert ENGINE.plain_tok_s(4) == pytest.approx(4 / 0.010)
    # K = 3 at c = 4: a forward over 16 tokens (10 ms) and three draft steps (3 ms) emit 4 × τ tokens
    assert ENGINE.spec_tok_s(4, 3, 2.7) == pytest.approx(4 * 2.7 / 0.013)
    # at c = 32 the verify forward is over 128 tokens: four times a plain step
    assert ENGINE.spec_step(32, 3) == pytest.approx(0.040 + 0.003)
    assert StepTimes(ENGINE.target, ENGINE.drafter, overhead=0.005).spec_step(4, 3) == pytest.approx(0.018)


def test_best_k_shrinks_and_speculation_loses_as_the_engine_becomes_compute_bound():
    rec = recommend(ENGINE, GOOD, concurrencies=(1, 4, 16, 64))
    best = {b["concurrency"]: b for b in rec["best"]}
    assert best[1]["k"] == 3 and best[1]["speedup"] == pytest.approx(2.7 / 1.3)
    assert best[16]["k"] < best[1]["k"]  # longer chains stop paying first
    assert not best[64]["pays"]
    # between 16 and 64: the largest concurrency at which some K still pays
    c = rec["break_even_concurrency"]
    assert 16 <= c < 64
    assert max(ENGINE.spec_tok_s(c, k, t) for k, t in GOOD.items()) > ENGINE.plain_tok_s(c)
    assert max(ENGINE.spec_tok_s(c + 1, k, t) for k, t in GOOD.items()) <= ENGINE.plain_tok_s(c + 1)
    table = {row["concurrency"]: row for row in rec["table"]}
    assert [r["k"] for r in table[4]["speculative"]] == [1, 2, 3]
    assert table[4]["speculative"][0]["speedup"] == pytest.approx((4 * 1.8 / 0.011) / (4 / 0.010))
    assert decision(rec) == (f"serve with K = 3 for up to {c} concurrent requests: 2.08 × faster "
                             "(predicted, concurrency 1)")


def test_a_drafter_that_does_not_pay_says_what_tau_it_would_need():
    rec = recommend(ENGINE, BAD)
    assert rec["break_even_concurrency"] == 0 and not any(b["pays"] for b in rec["best"])
    # K = 1 costs least: a 10 ms forward over 2 tokens plus a 1 ms draft step needs τ ≥ 1.1 against 10 ms
    assert rec["tau_needed"] == {"k": 1, "tau": pytest.approx(1.1)}
    assert decision(rec) == ("this drafter does not pay on this engine: τ 1.02 needs ≥ 1.10 (K = 1, "
                             "concurrency 1)")


def test_pays_at_every_concurrency_predicted():
    flat = StepTimes(target=[(1, 0.010), (1024, 0.010)], drafter=[(1, 0.0)])
    rec = recommend(flat, GOOD)
    assert rec["break_even_concurrency"] is None
    assert decision(rec).startswith("serve with K = 3 for 64 or more concurrent requests: 2.70 × faster")


def test_speculative_config_is_what_vllm_takes():
    assert json.loads(speculative_config("/d/eagle", 4)) == {"method": "eagle3", "model": "/d/eagle",
                                                             "num_speculative_tokens": 4}


def test_k_chains_replay_run_lengths_round_by_round():
    # run[s]: drafts accepted from context prompt + output[:s]; round 1 starts at s = 1 (after the prefill's token)
    run = [9, 3, 0, 1, 0, 2, 0, 0]
    # K = 1: s = 1 (accept 1) → 3 (1) → 5 (1) → 7 (0) → 8 ends
    assert chain_acceptance([run], 1) == {"k": 1, "drafts": 4, "accepted_per_pos": [3], "acceptance_length": 1.75,
                                          "per_position_acceptance": [0.75]}
    # K = 3: s = 1 (accept 3) → 5 (2) → 8 ends; a different set of rounds than K = 1 visits
    three = chain_acceptance([run], 3)
    assert (three["drafts"], three["accepted_per_pos"]) == (2, [2, 2, 1])
    assert three["acceptance_length"] == pytest.approx(3.5)
    assert chain_acceptance([[5]], 2)["drafts"] == 0  # one token, no round


def test_a_vllm_command_that_exits_fails_with_its_log(tmp_path: Path):
    """The error names the root cause even when the server logged it far above the tail (as vLLM's engine does)."""
    script = tmp_path / "server.py"
    script.write_text("import sys\nprint('(EngineCore) ValueError: no GPU here')\nprint('noise\\n' * 1000)\n"
                      "print('RuntimeError: Engine core initialization failed. See root cause above.')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match="exited 3") as err:
        with vllm(f"{sys.executable} {script}", tmp_path):
            pass
    assert "root cause: (EngineCore) ValueError: no GPU here" in str(err.value)
    assert "See root cause above" in str(err.value)  # and the tail


def test_a_parallel_drafter_pays_one_forward_for_k_drafts_and_the_comparison_picks_per_concurrency():
    """P-EAGLE drafts K tokens in one forward over c·K tokens: on a drafter that costs the same at any batch its
    draft time does not grow with K, where the chain's grows K-fold; compare_methods names, per concurrency, the
    method predicted faster from each one's own τ(K) and draft cost."""
    from services.evaluator.serving import compare_methods

    slow_drafter = [(1, 0.004), (64, 0.004), (512, 0.008)]
    chain = StepTimes(ENGINE.target, slow_drafter)
    parallel = StepTimes(ENGINE.target, slow_drafter, parallel=True)
    assert chain.draft_s(1, 3) == pytest.approx(0.012) and parallel.draft_s(1, 3) == pytest.approx(0.004)
    assert parallel.draft_s(1, 7) == parallel.draft_s(1, 1)
    assert parallel.spec_step(4, 3) == pytest.approx(0.010 + 0.004)
    assert json.loads(speculative_config("DIR", 3, "peagle"))["parallel_drafting"] is True
    assert "parallel_drafting" not in json.loads(speculative_config("DIR", 3))
    assert json.loads(speculative_config("DIR", 7, "dflash")) == {"method": "dflash", "model": "DIR",
                                                                 "num_speculative_tokens": 7}
    lower = {k: t - 0.1 for k, t in GOOD.items()}  # P-EAGLE accepts a little less
    out = compare_methods(ENGINE.target, [
        {"method": "eagle3", "drafter": "a", "tau_per_k": GOOD, "drafter_s": slow_drafter},
        {"method": "peagle", "drafter": "b", "tau_per_k": lower, "drafter_s": slow_drafter}])
    assert [m["method"] for m in out["methods"]] == ["eagle3", "peagle"]
    # at concurrency 1 the chain's 3 × 4 ms of drafting costs more than its extra τ buys
    assert out["choice"][0]["method"] == "peagle"
    speedups = {m["method"]: m["best"][0]["speedup"] for m in out["methods"]}
    assert out["choice"][0]["speedup"] == max(speedups.values())
    # with a free drafter the chain's higher τ wins everywhere
    free = [(1, 0.0), (512, 0.0)]
    out = compare_methods(ENGINE.target, [
        {"method": "eagle3", "drafter": "a", "tau_per_k": GOOD, "drafter_s": free},
        {"method": "peagle", "drafter": "b", "tau_per_k": lower, "drafter_s": free}])
    assert {c["method"] for c in out["choice"]} == {"eagle3"}

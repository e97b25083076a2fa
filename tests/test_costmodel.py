"""The serving cost model and recommendation (services/evaluator/costmodel.py) on made-up step times, the replay of
K-chains over run lengths (services/evaluator/chains.py; checked against real decoding in
tests/test_vllm_spec_decode.py), and a vLLM command that does not serve (services/evaluator/launch.py)."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

import pytest

from eyas.methods import get_method
from services.evaluator import alternatives
from services.evaluator import report as reports
from services.evaluator.chains import chain_acceptance, replay
from services.evaluator.costmodel import StepTimes, decision, interpolate, recommend
from services.evaluator.launch import has_module, serving_command, vllm
from services.evaluator.serving import engine_draft_times, fastest, noise, noise_bounds, predict
from services.evaluator.steptime import readings

# A memory-bound engine up to 32 tokens a step (10 ms whatever the batch), compute-bound beyond (linear); a drafter
# step costs 1 ms at any batch.
ENGINE = StepTimes(target=[(1, 0.010), (32, 0.010), (64, 0.020), (128, 0.040)], drafter=[(1, 0.001), (64, 0.001)])
GOOD = {1: 1.8, 2: 2.4, 3: 2.7}  # τ(K) of a drafter that accepts a lot
BAD = {1: 1.02, 2: 1.03, 3: 1.03}


def speculative_config(model: str, k: int, method: str = "eagle3") -> str:
    """The --speculative-config value the evaluator reports for a drafter of `method` (its method's)."""
    return json.dumps(get_method(method).speculative_config(model, k))


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
    assert decision(rec) == (f"serve with K = 3 for up to {c} concurrent requests: 2.08 × faster at concurrency 1 "
                             "(predicted; τ 2.70)")


def test_a_drafter_that_does_not_pay_says_what_tau_it_would_need():
    rec = recommend(ENGINE, BAD)
    assert rec["break_even_concurrency"] == 0 and not any(b["pays"] for b in rec["best"])
    # K = 1 costs least: a 10 ms forward over 2 tokens plus a 1 ms draft step needs τ ≥ 1.1 against 10 ms
    assert rec["tau_needed"] == {"k": 1, "tau": pytest.approx(1.1)}
    assert decision(rec) == ("this drafter does not pay on this engine: τ 1.02 needs ≥ 1.10 (K = 1, "
                             "concurrency 1)")
    # with the counts it rests on
    rec = recommend(ENGINE, BAD, evidence={"prompts": 16, "drafts_per_k": {"1": 412, "2": 300, "3": 1}})
    assert decision(rec) == ("this drafter does not pay on this engine: τ 1.02 from 412 drafts on 16 prompts needs "
                             "≥ 1.10 (K = 1, concurrency 1)")


def test_pays_at_every_concurrency_predicted():
    flat = StepTimes(target=[(1, 0.010), (1024, 0.010)], drafter=[(1, 0.0)])
    rec = recommend(flat, GOOD)
    assert rec["break_even_concurrency"] is None
    assert decision(rec).startswith("serve with K = 3 at every concurrency predicted (up to 64): 2.70 × faster")


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


def test_the_live_check_starts_vllm_wherever_it_is_installed_unless_turned_off(tmp_path: Path):
    """The evaluator's default (live_check auto): the operator's command, else the vLLM environment's OpenAI server
    (fp32, eager and a fixed KV-cache space on a CPU); none without either, or with live_check off."""
    from eyas.settings import Settings

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    auto = Settings(vllm_python=python, device="cpu", live_check="auto")
    command = serving_command(auto)
    assert command is not None and command.split()[1:5] == ["VLLM_CPU_KVCACHE_SPACE=2", str(python), "-m",
                                                            "vllm.entrypoints.openai.api_server"]
    assert "--dtype float32 --enforce-eager" in command
    assert serving_command(auto.model_copy(update={"vllm_command": "my-vllm"})) == "my-vllm"
    assert serving_command(auto.model_copy(update={"vllm_command": "my-vllm", "live_check": "off"})) is None
    assert serving_command(auto.model_copy(update={"vllm_python": tmp_path / "none"})) is None


def test_the_targets_step_times_are_kept_for_the_next_evaluation_until_they_age(monkeypatch, tmp_path):
    """The target's in-process readings are the machine's and the architecture's, not a drafter's: a second
    evaluation of the same target reuses them from the cache directory (in this process or another); other points,
    readings older than READINGS_KEPT_S or a damaged file are taken again; a cache that cannot be written is
    only not kept."""
    from eyas.target import BUNDLED, load_target
    from services.evaluator import steptime

    calls = []
    step = steptime._target_step
    monkeypatch.setattr(steptime, "_target_step", lambda *a: calls.append(1) or step(*a))
    target = load_target(BUNDLED)

    def times(points=(1, 2)):
        return steptime.target_step_times(target, points, cache_dir=tmp_path, check=lambda: None)

    first = times()
    taken = len(calls)
    assert taken == 2 * steptime.READINGS + 1  # a warm-up, then READINGS a point
    [kept] = (tmp_path / "step-times").iterdir()
    assert times() == first and len(calls) == taken  # read back, not measured
    times((1,))  # other points: measured
    assert len(calls) == taken + steptime.READINGS + 1
    for age_limit, damage in ((0.0, False), (3600.0, True)):  # aged, then a damaged file: measured again
        monkeypatch.setattr(steptime, "READINGS_KEPT_S", age_limit)
        if damage:
            kept.write_text("{not json")
        before = len(calls)
        assert times() and len(calls) == before + 2 * steptime.READINGS + 1
    assert len(list((tmp_path / "step-times").iterdir())) == 2  # no partial file left behind
    blocked = tmp_path / "a-file"  # a cache directory that cannot be made: measured, not kept, no error
    blocked.write_text("")
    before = len(calls)
    assert steptime.target_step_times(target, (1,), cache_dir=blocked, check=lambda: None)
    assert len(calls) == before + steptime.READINGS + 1


def test_a_vllm_command_that_exits_fails_with_its_log(tmp_path: Path):
    """The error names the root cause even when the server logged it far above the tail (as vLLM's engine does)."""
    script = tmp_path / "server.py"
    script.write_text("import sys\nprint('(EngineCore) ValueError: no GPU here')\nprint('noise\\n' * 1000)\n"
                      "print('RuntimeError: Engine core initialization failed. See root cause above.')\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match="exited 3") as err:
        with vllm(f"{sys.executable} {script}", tmp_path, check=lambda: None):
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


def test_a_k_without_drafts_is_reported_as_not_measured_and_the_decision_rests_on_the_others():
    """K = 3 had no drafts (τ None): its row says so, the best K and the decision come from K = 1 and 2, and the
    decision quotes the counts τ rests on."""
    evidence = {"prompts": 16, "drafts_per_k": {"1": 412, "2": 260, "3": 0}}
    rec = recommend(ENGINE, {1: 1.8, 2: 2.4, 3: None}, evidence=evidence)
    row = rec["table"][0]["speculative"][2]
    assert (row["k"], row["tau"], row["tok_s"], row["speedup"]) == (3, None, None, None)
    assert {b["k"] for b in rec["best"][:2]} <= {1, 2} and rec["best"][0]["k"] == 2
    assert rec["break_even_concurrency"] is not None and rec["break_even_concurrency"] >= 1
    assert decision(rec).endswith("(predicted; τ 2.40 from 260 drafts on 16 prompts)")
    assert "no drafts measured at K = 3" in reports.render_html(_measured_report(rec), [])


def test_answers_that_end_at_once_leave_no_draft_and_the_decision_says_it_cannot_tell():
    """Every prompt's answer is one token (it ended at once): the replay counts no draft at any K, τ is None
    everywhere; the prediction, the method comparison and the report's answer still come out, saying so."""
    per_k = replay([[7], [3], [0]], [1, 2, 3])
    assert all(a["drafts"] == 0 and a["acceptance_length"] is None for a in per_k.values())
    rec = predict(ENGINE, (ENGINE, ENGINE), per_k, 3, "DIR/eagle", get_method("eagle3"), 3)
    assert all(b["k"] is None and b["pays"] is None for b in rec["best"])
    assert rec["break_even_concurrency"] is None
    assert json.loads(rec["speculative_config"])["num_speculative_tokens"] == 3  # the evaluated K, to try it
    assert rec["decision"] == ("cannot tell whether this drafter pays: no drafts were measured at any K on 3 prompts "
                               "(answers that end at once leave nothing to draft); at K = 1 it would need τ ≥ 1.10 "
                               "at concurrency 1: evaluate on more prompts or longer answers")
    assert reports.plot_serving(rec)[:8] == b"\x89PNG\r\n\x1a\n"  # a plot with no line in it
    ans = reports.answer(rec, 3)
    assert ans["serve"] is None and ans["gains"] == "not known: no drafts were measured"
    assert ans["next"].startswith("score more prompts or longer answers: 3 prompts gave no draft")
    # beside a drafter whose τ was measured, the comparison picks that one; with none measured, none
    from services.evaluator.serving import compare_methods

    free = [(1, 0.0), (512, 0.0)]
    none = {1: None, 2: None, 3: None}
    out = compare_methods(ENGINE.target, [
        {"method": "eagle3", "drafter": "a", "tau_per_k": none, "drafter_s": free},
        {"method": "peagle", "drafter": "b", "tau_per_k": GOOD, "drafter_s": free}])
    assert {c["method"] for c in out["choice"]} == {"peagle"}
    out = compare_methods(ENGINE.target, [{"method": "eagle3", "drafter": "a", "tau_per_k": none,
                                           "drafter_s": free}])
    assert all(c["method"] is None and c["speedup"] is None for c in out["choice"])


# Recorded in-process readings (seconds) of a target forward over n tokens and a draft step at batch b: five per
# point, in the order they were read. On a quiet machine the fastest repeats; on a busy one (the first reading of
# 1, 2 and 4 tokens read 55, 88 and 76 ms) only one reading per point came through undisturbed.
QUIET_TARGET = [(1, [0.0502, 0.0500, 0.0501, 0.0530, 0.0500]), (2, [0.0521, 0.0520, 0.0520, 0.0522, 0.0560]),
                (4, [0.0550, 0.0551, 0.0551, 0.0550, 0.0590]), (8, [0.0600, 0.0601, 0.0605, 0.0600, 0.0600])]
BUSY_TARGET = [(1, [0.055, 0.050, 0.061, 0.059, 0.057]), (2, [0.088, 0.052, 0.067, 0.058, 0.071]),
               (4, [0.076, 0.055, 0.062, 0.069, 0.060]), (8, [0.060, 0.071, 0.066, 0.064, 0.069])]
DRAFTER = [(1, [0.0040, 0.0040, 0.0041, 0.0040, 0.0052]), (64, [0.0040, 0.0041, 0.0040, 0.0040, 0.0040])]
CLOSE = {1: 1.10, 2: 1.12, 3: 1.13}  # τ(K) that leaves the speed-up near 1 at concurrency 1


def _from_readings(target, drafter=DRAFTER):
    times = StepTimes(target=fastest(target), drafter=fastest(drafter))
    return times, noise_bounds(times, noise(target), noise(drafter))


def test_step_times_are_the_fastest_of_their_readings_and_their_spread_is_the_noise():
    assert fastest(BUSY_TARGET)[:3] == [(1, 0.050), (2, 0.052), (4, 0.055)]
    assert dict(noise(BUSY_TARGET))[2] == pytest.approx((0.058 - 0.052) / 0.052)
    assert dict(noise(QUIET_TARGET))[1] == 0.0  # the fastest came twice
    times, (fast, slow) = _from_readings(BUSY_TARGET)
    assert fast.plain_step(2) == pytest.approx(0.052 * (1 - 0.006 / 0.052))
    assert slow.plain_step(2) == pytest.approx(0.058)
    got = readings(lambda: None, repeats=4, warm_up=False)
    assert len(got) == 4 and got == sorted(got)  # fastest first


def test_noisy_step_times_make_the_decision_cannot_tell_and_quiet_ones_decide():
    """The same τ and the same fastest readings: on the quiet machine's readings the speed-up is below 1 within
    their noise (does not pay); on the busy one's, its interval straddles 1 (cannot tell, with the numbers)."""
    times, bounds = _from_readings(QUIET_TARGET)
    quiet = recommend(times, CLOSE, bounds=bounds)
    low, high = quiet["best"][0]["speedup_range"]
    assert high < 1.0 and quiet["best"][0]["pays"] is False
    assert decision(quiet).startswith("this drafter does not pay on this engine: τ 1.10 needs ≥ 1.12 (K = 1, "
                                      "concurrency 1")
    times, bounds = _from_readings(BUSY_TARGET)
    busy = recommend(times, CLOSE, bounds=bounds, evidence={"prompts": 16, "drafts_per_k": {"1": 412}})
    first = busy["best"][0]
    low, high = first["speedup_range"]
    assert low < 1.0 < high and first["pays"] is None
    assert first["speedup"] == quiet["best"][0]["speedup"]  # the point estimate alone would say "does not pay"
    assert decision(busy) == (f"cannot tell whether this drafter pays on this engine: {first['speedup']:.2f} × "
                              f"predicted at K = 1, concurrency 1, but the step times' noise allows {low:.2f}–"
                              f"{high:.2f} × (τ 1.10 from 412 drafts on 16 prompts): measure the step times on the "
                              "serving engine (--endpoint)")
    ans = reports.answer({**busy, "decision": decision(busy), "speculative_config": "{}"}, 16)
    assert ans["next"].startswith("measure on the serving engine: install vLLM")
    assert ans["breaks_even"].endswith("; within the step times' noise, though, that cannot be told at concurrency "
                                       f"{', '.join(str(b['concurrency']) for b in busy['best'] if b['pays'] is None)}")


# A 10-minute `make run` drafter, quiet (bench/README.md § Serving prediction): the in-process readings its evaluation
# took (target: tokens → s, fastest of 5, with their noise; drafter: batch → s) and its τ(K); vLLM-CPU then served it
# at K = 3 at 1.32 × plain decoding (1.19 × end to end)
IN_PROCESS = StepTimes(target=[(1, 0.0535), (2, 0.0871), (4, 0.0823), (8, 0.0985), (16, 0.1259), (32, 0.1951)],
                       drafter=[(1, 0.00186), (2, 0.00295), (4, 0.00353), (16, 0.00550)], engine=False)
IN_PROCESS_NOISE = ([(1, 0.005), (2, 0.028), (4, 0.031), (8, 0.013), (16, 0.021), (32, 0.004)],
                    [(1, 0.065), (2, 0.017), (4, 0.014), (16, 0.015)])
SERVED_TAU = {1: 1.241, 2: 1.294, 3: 1.311}


def test_in_process_step_times_cannot_say_a_drafter_does_not_pay_where_an_engines_verify_could_make_it_pay():
    """transformers' forward over 4 tokens cost 1.5× one token's on this CPU, vLLM-CPU's verify about one step: the
    same readings, taken as the engine's, said "does not pay" for a drafter vLLM served at 1.32 ×; taken as what
    they are, the interval reaches the verify at one step's cost, and the decision cannot tell. A drafter that
    would not pay even then still does not."""
    as_engine = dataclasses.replace(IN_PROCESS, engine=True)
    wrong = recommend(as_engine, SERVED_TAU, bounds=noise_bounds(as_engine, *IN_PROCESS_NOISE))
    assert wrong["best"][0]["k"] == 3 and wrong["best"][0]["speedup_range"][1] < 0.85
    assert decision(wrong).startswith("this drafter does not pay on this engine")

    rec = recommend(IN_PROCESS, SERVED_TAU, bounds=noise_bounds(IN_PROCESS, *IN_PROCESS_NOISE),
                    evidence={"prompts": 16, "drafts_per_k": {"1": 1700, "2": 1600, "3": 1554}})
    first = rec["best"][0]
    low, high = first["speedup_range"]
    assert first["speedup"] == wrong["best"][0]["speedup"] < 0.85 and first["pays"] is None and rec["engine"] is False
    assert low == pytest.approx(wrong["best"][0]["speedup_range"][0])  # the low end is the readings' own
    slowest = noise_bounds(IN_PROCESS, *IN_PROCESS_NOISE)[1]
    assert high == pytest.approx(1.311 * slowest.plain_step(1) / (0.0535 * 0.995 + 3 * 0.00186 * (1 - 0.065)))
    assert decision(rec) == (f"cannot tell whether this drafter pays on this engine: {first['speedup']:.2f} × "
                             f"predicted at K = 3, concurrency 1, but in-process step times (the target's, not an "
                             f"engine's, whose verify may cost one step) allow {low:.2f}–{high:.2f} × (τ 1.31 from "
                             "1554 drafts on 16 prompts): measure the step times on the serving engine (--endpoint)")
    bad = recommend(IN_PROCESS, BAD, bounds=noise_bounds(IN_PROCESS, *IN_PROCESS_NOISE))
    assert bad["best"][0]["pays"] is False and decision(bad).startswith("this drafter does not pay on this engine")


def _measured_report(rec: dict, decoded: int = 1) -> dict:
    """A report's JSON form around a recommendation, as the evaluator writes it (rendered without plots)."""
    serving = {**rec, "decision": decision(rec), "speculative_config": speculative_config("DIR/eagle", 3),
               "source": {"target": "in-process", "drafter": "in-process"},
               "step_noise": {"target": [(1, 0.02), (2, 0.10)], "drafter": [(1, 0.01)]}}
    return {"answer": reports.answer(serving, 16), "target": "t", "layout": {"aux_layers": [1, 14, 26]}, "k": 3,
            "per_position_accuracy": [], "acceptance_length": 1.4, "per_position_acceptance": [0.3, 0.08, 0.02],
            "exports": {"eagle": "DIR/eagle"}, "serving": serving,
            "acceptance": {"prompts": 1, "max_new_tokens": 1, "drafts": 1, "accepted_per_pos": [1, 0, 0]},
            "in_process": {"prompts": decoded, "matches_greedy": True, "greedy_mismatches": [],
                           "replay_matches": True}}


def test_the_report_opens_with_the_answer_and_reads_as_sentences():
    """The HTML leads with the verdict, the exact --speculative-config, the gain and the next step, then the
    evidence; counts are pluralised and a drafter that never pays says so in words."""
    page = reports.render_html(_measured_report(recommend(ENGINE, GOOD), decoded=2), [])
    assert page.index("<h2>Serve it</h2>") < page.index("--speculative-config '{&quot;method&quot;: &quot;eagle3")
    assert page.index("--speculative-config") < page.index("<h2>Evidence</h2>")
    assert "speculative output equals plain greedy output on all 2 prompts" in page
    assert "1 prompt of the prompt file, answered in up to 1 token" in page and "1 prompts" not in page
    assert "1 draft, 1 token accepted" in page
    never = reports.render_html(_measured_report(recommend(ENGINE, BAD)), [])
    assert "<h2>Do not serve it</h2>" in never and "concurrency 0" not in never
    assert "from the first request: it loses at every concurrency predicted" in never
    assert "speculative output equals plain greedy output on 1 prompt;" in never
    flat = StepTimes(target=[(1, 0.010), (1024, 0.010)], drafter=[(1, 0.0)])
    assert "never, at any concurrency predicted (up to 64)" in reports.render_html(
        _measured_report(recommend(flat, GOOD)), [])


# Recorded on vLLM-CPU (#44): 16 MT-bench first turns × 96 tokens at concurrency 1, plain 20.5 tok/s, the drafter
# 22.5 (τ 1.27), n-gram prompt lookup 26.7; suffix decoding not installed.
LIVE_C1 = {"concurrency": 1, "k": 3, "predicted_speedup": 0.84, "measured_speedup": 1.12, "relative_error": -0.25,
           "decode_tok_s": [21.0, 23.5], "measured_end_to_end_speedup": 22.5 / 20.5, "baseline_tok_s": 20.5,
           "speculative_tok_s": 22.5, "tau_in_process": 1.27, "tau_vllm": 1.27, "accepted_per_output_token": 0.192,
           "outputs_equal": True, "off": True}
NGRAM_C1 = {"method": "ngram", "served": True, "concurrency": 1, "config": alternatives.FREE_METHODS["ngram"],
            "tok_s": 26.7, "speedup": 26.7 / 20.5, "tau": 1.35, "accepted_per_output_token": 0.258, "why": None}
SUFFIX_MISSING = {"method": "suffix", "served": False, "concurrency": None,
                  "config": alternatives.FREE_METHODS["suffix"],
                  "tok_s": None, "speedup": None, "tau": None, "accepted_per_output_token": None,
                  "why": "vLLM not serving (exited 1); root cause: ImportError: Arctic Inference is required"}


def test_a_free_method_that_beats_the_drafter_is_the_answer_with_the_tau_the_drafter_needs():
    """The recorded case the in-process prediction got wrong: the measured choice names n-gram prompt lookup, the
    τ the drafter needs to pass it (speed-up linear in τ: 1.27 · 1.30 / 1.10) and the prompts that costs."""
    choice = alternatives.choose([LIVE_C1], [NGRAM_C1, SUFFIX_MISSING])
    assert [c["fastest"] for c in choice] == ["ngram"]
    assert choice[0]["speedups"] == pytest.approx({"plain": 1.0, "drafter": 1.0976, "ngram": 1.3024}, rel=1e-3)
    assert alternatives.tau_to_pass(choice[0]) == pytest.approx(1.27 * 26.7 / 22.5)
    line = alternatives.served_decision(choice[0])
    assert line.startswith("serve n-gram prompt lookup, not this drafter yet: 1.30 × plain decoding against the "
                           "drafter's 1.10 ×")
    assert "the drafter needs τ ≥ 1.51 (now 1.27)" in line and "about 4–6 doublings of its training prompts" in line
    # the drafter ahead: it is the answer, the rival quoted; nothing ahead: plain decoding
    ahead = alternatives.choose([{**LIVE_C1, "measured_end_to_end_speedup": 1.4}], [NGRAM_C1])[0]
    assert ahead["fastest"] == "drafter" and alternatives.tau_to_pass(ahead) is None
    assert alternatives.served_decision(ahead) == ("serve this drafter: 1.40 × plain decoding, measured on vLLM at "
                                                   "concurrency 1 (against n-gram prompt lookup 1.30 ×)")
    slow = alternatives.choose([{**LIVE_C1, "measured_end_to_end_speedup": 0.9}], [{**NGRAM_C1, "speedup": 0.95}])[0]
    assert slow["fastest"] == "plain"
    assert alternatives.served_decision(slow).startswith("serve plain decoding: nothing measured was faster")


def test_a_drafter_measured_fastest_is_served_at_the_k_that_was_measured():
    """After the live check the prediction is made again from the engine's times, and may name another K than the
    one the speculative server ran; the answer's --speculative-config is the measured one."""
    report = _measured_report(recommend(ENGINE, GOOD))
    serving = report["serving"]
    live = {**LIVE_C1, "k": 2, "measured_end_to_end_speedup": 1.4}
    served = alternatives.choose([live], [NGRAM_C1])
    serving.update(live_check=[live], alternatives=[NGRAM_C1], served=served, decision=alternatives.served_decision(
        served[0]))
    answer = reports.answer(serving, 16)
    assert answer["serve"] is True and json.loads(serving["speculative_config"])["num_speculative_tokens"] == 3
    assert json.loads(answer["speculative_config"]) == {**json.loads(serving["speculative_config"]),
                                                        "num_speculative_tokens": 2}


def test_the_report_answers_with_what_was_measured_fastest_and_lists_every_method():
    rec = recommend(ENGINE, GOOD)
    report = _measured_report(rec)
    serving = report["serving"]
    served = alternatives.choose([LIVE_C1], [NGRAM_C1, SUFFIX_MISSING])
    serving.update(live_check=[LIVE_C1], alternatives=[NGRAM_C1, SUFFIX_MISSING], served=served,
                   predicted_decision=serving["decision"], decision=alternatives.served_decision(served[0]))
    report["answer"] = reports.answer(serving, 16)
    assert report["answer"]["serve"] is False  # the prediction said serve it; the measurement says n-gram
    assert "serve n-gram prompt lookup now (--speculative-config '{\"method\": \"ngram\"" in report["answer"]["next"]
    page = reports.render_html(report, [])
    assert page.index("<h2>Do not serve it</h2>") < page.index("Serve n-gram prompt lookup, not this drafter yet")
    table = page[page.index("What to serve"):]
    for row in ("plain decoding</td><td>20.5</td><td>1.00 ×", "this drafter (K = 3)</td><td>22.5</td><td>1.10 ×",
                "n-gram prompt lookup</td><td>26.7</td><td>1.30 ×</td><td>1.3500</td><td>0.2580"):
        assert row in table
    assert "suffix decoding</th><td>not served by this engine: vLLM not serving (exited 1)" in table
    assert "predicted (before measuring)" in table
    # the in-process prediction missed the measurement by 25 %: flagged beside it
    assert "(-25.0%), 1.098 × end to end; τ 1.2700 in-process, 1.2700 on vLLM — the prediction is off by more " \
           "than 15%: trust the measurement here" in page


def test_the_drafters_cost_in_the_engine_is_its_speculative_step_less_the_verify():
    """engine_draft_times inverts the cost model: speculative steps timed on a server at K (here made from a known
    drafter) give back that drafter's step times, chained or parallel; the prediction from them then equals the
    measured step's rate at that K, and the cost of another K follows from them."""
    for parallel, drafter in ((False, [(1, 0.002), (4, 0.003), (16, 0.006)]),
                              (True, [(3, 0.004), (12, 0.005), (48, 0.009)])):
        known = StepTimes(target=ENGINE.target, drafter=drafter, parallel=parallel)
        steps = [(b, known.spec_step(b, 3)) for b in (1, 4, 16)]
        got = engine_draft_times(steps, ENGINE.target, 3, parallel)
        assert [x for x, _ in got] == [x for x, _ in drafter]
        assert [t for _, t in got] == pytest.approx([t for _, t in drafter])
        engine = StepTimes(target=ENGINE.target, drafter=got, parallel=parallel)
        assert [engine.spec_step(b, 3) for b in (1, 4, 16)] == pytest.approx([t for _, t in steps])
        assert engine.spec_step(1, 5) == pytest.approx(known.spec_step(1, 5))
    # a verify read slower than the whole step (noise) costs the drafter nothing, never less
    assert engine_draft_times([(1, 0.005)], ENGINE.target, 3, False) == [(1, 0.0)]


def test_a_free_method_whose_server_does_not_start_is_a_row_not_an_error(tmp_path: Path):
    script = tmp_path / "server.py"
    script.write_text("import sys\nprint('ImportError: Arctic Inference is required for suffix decoding')\n"
                      "sys.exit(1)\n")
    rows = alternatives.measure_free([], 8, {1: 20.0}, lambda config: vllm(f"{sys.executable} {script}", tmp_path,
                                                                           config, check=lambda: None),
                                     None, lambda: None, methods={"suffix": alternatives.FREE_METHODS["suffix"]})
    assert rows == [{"method": "suffix", "served": False, "concurrency": None,
                     "config": alternatives.FREE_METHODS["suffix"], "tok_s": None, "speedup": None, "tau": None,
                     "accepted_per_output_token": None, "why": rows[0]["why"]}]
    assert "root cause: ImportError: Arctic Inference is required" in rows[0]["why"]


def test_a_free_method_whose_module_the_engine_lacks_is_a_row_without_a_start():
    """Suffix decoding needs arctic-inference in the engine's environment: where the engine's Python is known to lack
    it, no server is started for it (a failed start costs vLLM's imports); where it is not known (a container), the
    start is tried."""
    python = shlex.join(["env", "VLLM_CPU_KVCACHE_SPACE=2", sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
    assert has_module(python, "json") is True and has_module(python, "no_such_module_here") is False
    assert has_module("docker run --rm vllm/vllm-openai", "json") is None

    def start(config):
        raise AssertionError(f"started {config}")

    rows = alternatives.measure_free([], 8, {1: 20.0}, start, None, lambda: None,
                                     methods={"suffix": alternatives.FREE_METHODS["suffix"]},
                                     has_module=lambda module: has_module(python, module + "_not_here"))
    assert [(r["method"], r["served"]) for r in rows] == [("suffix", False)]
    assert "needs the arctic_inference package" in rows[0]["why"]

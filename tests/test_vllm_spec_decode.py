"""The exported drafter in real vLLM (CPU, fp32, eager): it loads, serves, and the acceptance vLLM reports on its
/metrics counters agrees with the in-process evaluator's on the same prompts, max_tokens and greedy decoding.

One vLLM server start (module fixture). The drafter is trained here (embedded train job) on the session's
`bundled_features` (tests/conftest.py: the target's own greedy answers to a few prompts, generated and extracted once
for the files that train on them), so it accepts many tokens on exactly those prompts: the agreement check runs on
them (through the evaluator's functions; the evaluate stage itself refuses prompts the drafter was trained on). The
evaluate stage then runs with the server as its live endpoint on held-out MT-bench prompts, and its report carries
both measurements.

Tolerance: services/evaluator/specdec.py reproduces vLLM's chain proposer, verifier and counting, so in fp32 the
two agree exactly unless a near-tie argmax flips between vLLM's and PyTorch's kernels. The tests assert
|τ_in-process − τ_vLLM| ≤ 5 % of τ_vLLM and per-position acceptance within 0.05, and print the exact numbers.

Serving prediction (services/evaluator/serving.py): the evaluate stage measures step times on the plain server (the
session's `vllm_url`), predicts the speed-up per concurrency and K, starts the speculative server itself
(Settings.vllm_command) at the K it recommends, and checks the prediction live at concurrency 1 and 4, in the
steady state the model predicts (all streams decoding; the end-to-end A/B's prefills and last partial batch are
printed beside). The tests assert what the check reports, not how close the prediction comes: that is a timing on a
shared machine, measured by bench/serving.py.
"""
from __future__ import annotations

import json
import shlex

import httpx
import pytest

from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.methods import get_method, load_drafter
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, bundled_target_dir, load_target
from orchestration.embedded import EmbeddedRunner
from orchestration.proxy.recorder import traffic_store
from orchestration.watch.settings import WatchSettings
from orchestration.watch.watch import open_watch
from services.evaluator import alternatives
from services.evaluator.chains import drafted_ks, replay, run_lengths
from services.evaluator.live import read_counters, timed_completions
from services.evaluator.specdec import eval_prompts, measure_acceptance
from services.trainer.spec import CPU_PRESET
from tests.conftest import BUNDLED_ANSWER_TOKENS
from tests.servers import TEST_SERVER_ENV, VLLM_PYTHON, vllm_starting
from tests.test_evaluator import local_path

pytestmark = pytest.mark.vllm

K = 3
MAX_TOKENS = BUNDLED_ANSWER_TOKENS
TAU_TOLERANCE = 0.05  # relative
POS_TOLERANCE = 0.05  # absolute, per position


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bundled_features):
    work = tmp_path_factory.mktemp("eyas-vllm-spec")
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[tmp_path_factory.getbasetemp()]))
    [job] = emb.run_job("train", {"features": bundled_features.features, **CPU_PRESET, "steps": 40, "warmup": 5,
                                  "val_interval": 0})
    assert job.state == "succeeded", job.error
    return emb, job.artifacts["output"], bundled_features.prompts


@pytest.fixture(scope="module")
def served(trained):
    """The drafter served by vLLM: launched here, waited for at its first `url()` (the first test decodes in-process
    meanwhile)."""
    _, drafter, _ = trained
    spec_config = {"method": "eagle3", "model": str(local_path(drafter) / "eagle"), "num_speculative_tokens": K}
    with vllm_starting(bundled_target_dir(), speculative_config=spec_config) as server:
        yield server


def agree(ours: dict, vllm: dict) -> None:
    print(f"\nτ in-process {ours['acceptance_length']:.4f} {ours['per_position_acceptance']} "
          f"({ours['drafts']} drafts, {ours['accepted']} accepted)\n"
          f"τ vLLM       {vllm['acceptance_length']:.4f} {vllm['per_position_acceptance']} "
          f"({vllm['drafts']} drafts, {vllm['accepted']} accepted)")
    assert abs(ours["acceptance_length"] - vllm["acceptance_length"]) <= TAU_TOLERANCE * vllm["acceptance_length"]
    for a, b in zip(ours["per_position_acceptance"], vllm["per_position_acceptance"], strict=True):
        assert abs(a - b) <= POS_TOLERANCE


def test_exported_drafter_serves_in_vllm_and_acceptance_agrees(trained, served):
    _, drafter, prompt_file = trained
    target = load_target(BUNDLED)
    d, _ = load_drafter(local_path(drafter) / "eagle", target.model.get_input_embeddings().weight.detach())
    layout = Layout.from_dict(read_manifest(open_artifact(drafter), kind="drafter").layout)
    prompts = eval_prompts(target.tokenizer, str(prompt_file))
    ours = measure_acceptance(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
    vllm = timed_completions(served.url(), prompts, MAX_TOKENS, counters=True)

    # the drafter loaded and served every request, and both produce the target's own greedy output
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    assert vllm["outputs"] == [p["output"] for p in ours["per_prompt"]]
    # a drafter that actually accepts tokens, so the comparison means something
    assert ours["accepted"] > 0 and vllm["accepted"] > 0
    agree(ours, vllm)


def test_evaluate_stage_reports_vllm_acceptance_beside_its_own(trained, served):
    emb, drafter, _ = trained
    [job] = emb.run_job("evaluate", {"drafter": drafter, "num_prompts": 3, "k": K, "max_new_tokens": 32,
                                     "spec_endpoint": served.url(), "second_prompts": None})
    assert job.state == "succeeded", job.error
    report = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))
    ours, vllm = report["in_process"], report["live"]["speculative"]
    assert report["prompts"]["source"] == "bundled:mt_bench"
    assert ours["matches_greedy"] and vllm["matches_in_process_greedy"] and vllm["tokens"] == ours["tokens"]
    assert vllm["drafts"] == ours["drafts"] > 0
    agree(ours, vllm)
    assert job.metrics["live_acceptance_length"] == vllm["acceptance_length"]


def test_the_watch_reads_the_served_acceptance_and_knows_the_target(trained, served, tmp_path):
    """`eyas watch` on the real engine: two readings of vLLM's /metrics around a few requests give that interval's
    drafts and τ (vLLM's own counts between the readings), judged against a baseline; the endpoint's model and its
    /tokenize rendering are the drafter's recorded target's (the bundled target, its tokenizer here)."""
    emb, drafter, prompt_file = trained
    endpoint = served.url()
    prompts = eval_prompts(load_target(BUNDLED).tokenizer, str(prompt_file))[:3]
    settings = Settings(workdir=tmp_path / "eyas")
    first = timed_completions(endpoint, prompts, MAX_TOKENS, counters=True)
    watch = open_watch(WatchSettings(endpoint=endpoint, drafter=drafter, baseline=first["acceptance_length"],
                                     min_drafts=1, window=1), settings, traffic_store(settings))
    # the readings after vLLM's counters settle (the last requests' drafts land there with a lag)
    before = read_counters(endpoint)
    watch.check()  # the first reading: the engine's totals so far
    timed_completions(endpoint, prompts, MAX_TOKENS)
    interval = (read_counters(endpoint) - before).summary()
    status = watch.check()
    assert status.drafts == interval["drafts"] > 0
    assert status.tau == pytest.approx(interval["acceptance_length"])
    assert status.state == "current", status.sentence  # the same prompts again: the baseline's τ
    checks = {c.name: c.state for c in status.checks}
    assert checks["rendering"] == checks["config"] == "same", status.checks  # against the drafter's recorded hashes
    assert checks["model"] != "changed", status.checks
    assert watch.series.points()[-1].drafts == status.drafts  # kept in the store


def test_one_pass_acceptance_per_k_equals_a_real_k_chain(trained):
    """τ(K) from one K_max = 7 teacher-forced pass, replayed as K = 2 chains, equals a real K = 2 speculative run
    count for count. (A K = 7 run's acceptance truncated to 2 positions would not: its rounds start elsewhere.)"""
    _, drafter, prompt_file = trained
    target = load_target(BUNDLED)
    d, _ = load_drafter(local_path(drafter) / "eagle", target.model.get_input_embeddings().weight.detach())
    layout = Layout.from_dict(read_manifest(open_artifact(drafter), kind="drafter").layout)
    prompts = eval_prompts(target.tokenizer, str(prompt_file))
    real = measure_acceptance(target, d, layout.aux_layers, prompts, 2, MAX_TOKENS)
    per_k = replay([run_lengths(target, d, layout.aux_layers, p.ids, r["output"], 7)
                    for p, r in zip(prompts, real["per_prompt"], strict=True)], drafted_ks(d, 7))
    print(f"\nK = 2 run: {real['drafts']} drafts, accepted per position {real['accepted_per_pos']}; replayed: "
          f"{per_k[2]['drafts']}, {per_k[2]['accepted_per_pos']}; K = 7 replayed: {per_k[7]['accepted_per_pos']} "
          f"of {per_k[7]['drafts']}")
    assert real["matches_greedy"] and real["accepted"] > 0
    assert (per_k[2]["drafts"], per_k[2]["accepted_per_pos"]) == (real["drafts"], real["accepted_per_pos"])
    assert set(per_k) == set(range(1, 8))


def test_serving_prediction_checked_live_at_two_concurrencies(trained, vllm_url, monkeypatch):
    """Step times measured on the plain server (the session's), the prediction per concurrency and K, and the live
    check: Settings.vllm_command (the operator's, never a job's) makes the evaluator start vLLM with the drafter at
    the K it recommends on a loopback port, run the A/B at concurrency 1 and 4 against the plain endpoint, and stop
    the server it started."""
    emb, drafter, _ = trained
    # what the test servers run with (tests/servers.py), the plain endpoint (the session's) included
    for name, value in TEST_SERVER_ENV.items():
        monkeypatch.setenv(name, value)
    command = shlex.join([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--dtype", "float32",
                          "--enforce-eager", "--max-model-len", "2048", "--seed", "0"])
    runner = EmbeddedRunner(emb.settings.model_copy(update={"vllm_command": command, "live_check": "auto"}))
    [job] = runner.run_job("evaluate", {"drafter": drafter, "num_prompts": 4, "k": K, "max_new_tokens": 32,
                                        "endpoint": vllm_url, "second_prompts": None})
    assert job.state == "succeeded", job.error
    serving = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))["serving"]
    recommended = serving["best"][0]["k"]
    print(f"\ntarget step s (batch b, vLLM): {[(b, round(t, 4)) for b, t in serving['target_s']]}"
          f"\nspeculative step s (batch b, vLLM): {[(b, round(t, 4)) for b, t in serving['spec_step_s']]}, "
          f"{serving['spec_tokens_per_step']:.3f} tokens a step (counters: τ {serving['spec_step_tau']:.3f})"
          f"\ndrafter step s (batch b, in the engine): {[(b, round(t, 4)) for b, t in serving['drafter_s']]}"
          f"\ndrafter step s (batch b, in-process): {[(b, round(t, 4)) for b, t in serving['drafter_s_in_process']]}"
          f"\nτ(K): {serving['tau_per_k']}\nbest: {serving['best']}\n{serving['decision']}")
    for run in serving["live_check"]:
        print(f"concurrency {run['concurrency']}, K = {run['k']}: predicted {run['predicted_speedup']:.3f} ×, "
              f"measured {run['measured_speedup']:.3f} × while decoding ({run['relative_error']:+.1%}; plain, "
              f"speculative {run['decode_tok_s'][0]:.1f}, {run['decode_tok_s'][1]:.1f} tok/s), end to end "
              f"{run['measured_end_to_end_speedup']:.3f} × ({run['baseline_tok_s']:.1f}, {run['speculative_tok_s']:.1f}"
              f" tok/s); τ in-process {run['tau_in_process']:.3f}, vLLM {run['tau_vllm']:.3f}")
    # the speculative server ran the K first recommended (from in-process draft times: the prediction made again
    # from the engine's may name another); the plain endpoint was the job's (still up); the one it started is gone
    started_k = serving["live_endpoints"]["spec_k"]
    assert [(r["concurrency"], r["k"]) for r in serving["live_check"]] == [(1, started_k), (4, started_k)]
    assert serving["live_endpoints"]["endpoint"] == vllm_url and serving["live_endpoints"]["started"] == ["spec"]
    assert httpx.get(f"{vllm_url}/health", timeout=5).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{serving['live_endpoints']['spec_endpoint']}/health", timeout=5)
    # the drafter's cost measured in the engine: the speculative server's step at the batches timed, where a streamed
    # chunk is one engine step (its tokens per chunk are the counters' τ over the same runs)
    assert serving["source"]["drafter"].startswith("vLLM speculative server")
    assert serving["step_noise"]["drafter"] is None
    assert [b for b, _ in serving["spec_step_s"]] == [b for b, _ in serving["drafter_s"]] == [1, 4, 16]
    assert serving["spec_tokens_per_step"] == pytest.approx(serving["spec_step_tau"], rel=0.1)
    assert len(serving["drafter_s_in_process"]) == 7
    for run in serving["live_check"]:
        assert run["off"] == (abs(run["relative_error"]) > 0.15)
        assert run["outputs_equal"]  # speculation changed no greedy output
        assert run["predicted_speedup"] > 0 and run["measured_speedup"] > 0
        assert run["relative_error"] == pytest.approx((run["predicted_speedup"] - run["measured_speedup"])
                                                      / run["measured_speedup"])
        plain, spec = run["decode_tok_s"]
        assert run["measured_speedup"] == pytest.approx(spec / plain)
        assert abs(run["tau_in_process"] - run["tau_vllm"]) <= TAU_TOLERANCE * run["tau_vllm"]
    assert [row["concurrency"] for row in serving["table"]] == [1, 4, 16, 64]
    assert list(serving["tau_per_k"]) == [str(k) for k in range(1, 8)]
    assert json.loads(serving["speculative_config"])["num_speculative_tokens"] == recommended
    # the free alternatives on the same prompts and engine: n-gram prompt lookup served at both concurrencies;
    # suffix decoding served, or a row with the engine's reason (it needs arctic-inference); the decision is the
    # fastest measured
    ngram = [r for r in serving["alternatives"] if r["method"] == "ngram"]
    assert [r["concurrency"] for r in ngram] == [1, 4] and all(r["served"] and r["speedup"] > 0 for r in ngram)
    assert all(r["tau"] is not None and 0 <= r["accepted_per_output_token"] < 1 for r in ngram)
    suffix = [r for r in serving["alternatives"] if r["method"] == "suffix"]
    assert suffix and all(r["served"] or r["why"] for r in suffix)
    print("alternatives:", [(r["method"], r["concurrency"], r["speedup"], r["why"]) for r in serving["alternatives"]],
          "\nserved:", serving["served"], "\n", serving["decision"])
    first = serving["served"][0]
    assert first["concurrency"] == 1 and first["speedup"] == max(first["speedups"].values())
    assert serving["decision"].startswith(f"serve {alternatives.LABELS[first['fastest']]}")
    assert job.metrics["serving_decision"] == serving["decision"]


def test_peagle_from_the_same_features_serves_with_parallel_drafting(trained):
    """P-EAGLE trains on the EAGLE-3 drafter's own features artifact (no new extraction), exports what vLLM serves
    with "parallel_drafting": true (the EAGLE-3 architecture, a top-level mask_token_id and mask_hidden), and vLLM's
    acceptance on it equals the in-process count, which the one-pass replay equals count for count."""
    emb, eagle3, prompt_file = trained
    features = read_manifest(open_artifact(eagle3), kind="drafter").inputs[0]
    [job] = emb.run_job("train", {"features": features, **CPU_PRESET, "method": "peagle", "steps": 40,
                                  "warmup": 5, "val_interval": 0})
    assert job.state == "succeeded", job.error
    eagle_dir = local_path(job.artifacts["output"]) / "eagle"
    serve = get_method("peagle").speculative_config(str(eagle_dir), K)
    assert serve["parallel_drafting"] is True
    with vllm_starting(bundled_target_dir(), speculative_config=serve) as server:  # it starts while we decode
        config = json.loads((eagle_dir / "config.json").read_text())
        target = load_target(BUNDLED)
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["mask_token_id"] == target.model.config.vocab_size - 1
        spec_cfg = json.loads((eagle_dir.parent / "speculators" / "config.json").read_text())
        assert spec_cfg["speculators_model_type"] == "peagle" and spec_cfg["mask_token_id"] == config["mask_token_id"]
        d, _ = load_drafter(eagle_dir, target.model.get_input_embeddings().weight.detach())
        assert d.cfg.mask_token_id == config["mask_token_id"] and d.mask_hidden.abs().sum() > 0  # trained
        layout = Layout.from_dict(read_manifest(open_artifact(job.artifacts["output"]), kind="drafter").layout)
        prompts = eval_prompts(target.tokenizer, str(prompt_file))
        ours = measure_acceptance(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
        per_k = replay([run_lengths(target, d, layout.aux_layers, p.ids, r["output"], 7)
                        for p, r in zip(prompts, ours["per_prompt"], strict=True)], drafted_ks(d, 7))
        assert (per_k[K]["drafts"], per_k[K]["accepted_per_pos"]) == (ours["drafts"], ours["accepted_per_pos"])
        vllm = timed_completions(server.url(), prompts, MAX_TOKENS, counters=True)
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    assert vllm["outputs"] == [p["output"] for p in ours["per_prompt"]]
    assert ours["accepted"] > 0 and vllm["accepted"] > 0
    agree(ours, vllm)


def test_dflash_from_the_same_features_serves_in_vllm(trained):
    """DFlash trains on the same features too (its target layers are theirs), exports vLLM's DFlashDraftModel, and
    vLLM-CPU serving it at its block's K counts what the in-process block drafts count, which the replay equals."""
    emb, eagle3, prompt_file = trained
    features = read_manifest(open_artifact(eagle3), kind="drafter").inputs[0]
    [job] = emb.run_job("train", {"features": features, **CPU_PRESET, "method": "dflash", "steps": 60,
                                  "warmup": 5, "val_interval": 0})
    assert job.state == "succeeded", job.error
    manifest = read_manifest(open_artifact(job.artifacts["output"]), kind="drafter")
    assert manifest.drafter.method == "dflash" and "sglang" in manifest.drafter.unsupported_engines
    out = local_path(job.artifacts["output"]) / "dflash"
    config = json.loads((out / "config.json").read_text())
    layout = Layout.from_dict(manifest.layout)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == list(layout.aux_layers)  # vLLM captures each + 1
    k = config["block_size"] - 1
    assert k == CPU_PRESET["ttt_steps"]
    serve = get_method("dflash").speculative_config(str(out), k)
    with vllm_starting(bundled_target_dir(), speculative_config=serve) as server:  # it starts while we decode
        target = load_target(BUNDLED)
        d, _ = load_drafter(out, target.model.get_input_embeddings().weight.detach(),
                            lm_head_weight=target.model.get_output_embeddings().weight.detach())
        assert d.cfg.block_size - 1 == k
        prompts = eval_prompts(target.tokenizer, str(prompt_file))
        ours = measure_acceptance(target, d, layout.aux_layers, prompts, k, MAX_TOKENS)
        per_k = replay([run_lengths(target, d, layout.aux_layers, p.ids, r["output"], k)
                        for p, r in zip(prompts, ours["per_prompt"], strict=True)], drafted_ks(d, k))
        assert (per_k[k]["drafts"], per_k[k]["accepted_per_pos"]) == (ours["drafts"], ours["accepted_per_pos"])
        vllm = timed_completions(server.url(), prompts, MAX_TOKENS, counters=True)
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    assert vllm["outputs"] == [p["output"] for p in ours["per_prompt"]]
    assert ours["accepted"] > 0 and vllm["accepted"] > 0
    agree(ours, vllm)

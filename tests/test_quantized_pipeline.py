"""A quantized target end to end (issue #46): a tiny Llama-3 quantized to compressed-tensors W8A8 INT8 (weights per
channel, activations per token, dynamic, asymmetric: the INT8 format vLLM-CPU serves in fp32, docs/quantized-targets.md)
— its conversations generated, its states captured by vLLM's engine (as the target is served), a drafter trained on
them, evaluated, and served by vLLM against the same quantized target.

- The layout records the precision the states were captured at (dtype and quantization), and it travels to the
  drafter and its export; the same network unquantized has the same config hash (the drafter is valid for it), and
  the evaluate stage's wiring check (check_wiring) warns, naming both precisions, when the target differs from the
  captured one.
- τ: vLLM's counters against the in-process evaluator's, on the drafter's training prompts, within the 5 % that
  test_vllm_spec_decode allows a float target. Exact equality is not expected: in process, transformers runs
  compressed-tensors' reference arithmetic (activations fake-quantized per token), vLLM-CPU its oneDNN INT8 kernel,
  and activation quantization turns a float rounding difference into a whole quantum. The same amplification makes
  the in-process speculative output differ from the in-process greedy one now and then (a verify pass of K + 1
  tokens and a one-token step round differently), which a float target never shows: the test prints how often.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.methods import load_drafter
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import config_hash, load_target
from orchestration.embedded import EmbeddedRunner
from services.evaluator.live import timed_completions
from services.evaluator.specdec import eval_prompts, greedy, measure_acceptance, stop_ids
from services.evaluator.wiring import check_wiring
from services.trainer.spec import CPU_PRESET
from tests.families import FAMILIES, build_target
from tests.quantized import quantize_target
from tests.servers import vllm_starting
from tests.test_evaluator import PROMPTS, local_path, write_prompts

FMT = "w8a8-int8-asym"
PRECISION = ("compressed-tensors weights int8 channel, activations int8 token dynamic asymmetric, in float32")
K = 3
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    float_dir = build_target(FAMILIES["llama3"], root / "llama3")
    target = str(quantize_target(float_dir, root / f"llama3-{FMT}", FMT))
    prompts = write_prompts(root / "prompts.jsonl", PROMPTS)
    emb = EmbeddedRunner(Settings(workdir=root / "eyas", input_roots=[root]))
    evaluate = {"num_prompts": 2, "max_new_tokens": 16, "k": K}
    jobs = emb.run_job("generate", {
        "prompts": str(prompts), "target": target, "max_turns": 1,
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        "then": [{"stage": "extract", "target": target, "engine": "vllm"},
                 {"stage": "train", **CPU_PRESET, "steps": 60, "warmup": 5, "val_interval": 0},
                 {"stage": "evaluate", **evaluate, "target": target}]})
    assert [j.state for j in jobs] == ["succeeded"] * 4, [(j.stage, j.error) for j in jobs]
    jobs = {j.stage: j for j in jobs}
    return {"target": target, "float": float_dir, "prompts": prompts, "jobs": jobs}


def _report(job) -> dict:
    return json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))


def test_the_captured_precision_travels_and_the_wiring_check_warns_on_another(pipeline):
    jobs = pipeline["jobs"]
    features = read_manifest(open_artifact(jobs["extract"].artifacts["output"]), kind="features")
    assert features.extra["compute"]["engine"] == "vllm"  # captured as the target is served
    drafter = read_manifest(open_artifact(jobs["train"].artifacts["output"]), kind="drafter")
    eagle = json.loads((local_path(jobs["train"].artifacts["output"]) / "eagle" / "config.json").read_text())
    for layout in (features.layout, drafter.layout, eagle["eyas_layout"]):
        assert layout["precision"] == PRECISION
    # the quantization is not the network: the float copy has the quantized one's config hash
    assert config_hash(pipeline["float"]) == config_hash(Path(pipeline["target"])) == features.layout[
        "target_config_hash"]
    same = _report(jobs["evaluate"])["wiring"]["precision"]
    assert (same["trained"], same["target"], same.get("warning")) == (PRECISION, PRECISION, None)
    # the same drafter checked against the float target (the evaluate stage's step 1)
    other = check_wiring(Layout.from_dict(drafter.layout), local_path(jobs["train"].artifacts["output"]),
                         load_target(str(pipeline["float"])))
    assert other["ok"] and other["precision"]["target"] == "float32"
    assert PRECISION in other["precision"]["warning"] and "float32" in other["precision"]["warning"]


@pytest.mark.vllm
def test_vllm_serves_the_drafter_on_the_quantized_target(pipeline):
    uri = pipeline["jobs"]["train"].artifacts["output"]
    spec = {"method": "eagle3", "model": str(local_path(uri) / "eagle"), "num_speculative_tokens": K}
    with vllm_starting(Path(pipeline["target"]), speculative_config=spec) as server:  # starts while we decode
        target = load_target(pipeline["target"])
        d, _ = load_drafter(local_path(uri) / "eagle", target.model.get_input_embeddings().weight.detach())
        layout = Layout.from_dict(read_manifest(open_artifact(uri), kind="drafter").layout)
        prompts = eval_prompts(target.tokenizer, str(pipeline["prompts"]))
        ours = measure_acceptance(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
        reference = greedy(target, [p.ids for p in prompts], MAX_TOKENS, stop_ids(target))
        vllm = timed_completions(server.url(), prompts, MAX_TOKENS, counters=True)
    agree = [next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), len(ref))
             for out, ref in zip(vllm["outputs"], reference, strict=True)]
    print(f"\n{FMT}: τ vLLM {vllm['acceptance_length']:.3f} ({vllm['drafts']} drafts, {vllm['accepted']} accepted), "
          f"in-process {ours['acceptance_length']:.3f} ({ours['drafts']} drafts, {ours['accepted']} accepted); "
          f"greedy outputs agree for {agree} of {MAX_TOKENS} tokens")
    print(f"in-process speculative output differs from its greedy output on {len(ours['greedy_mismatches'])} of "
          f"{len(prompts)} prompts")
    assert vllm["drafts"] > 0 and vllm["accepted"] > 0  # vLLM drafted with it on the quantized target, and accepted
    assert ours["accepted"] > 0
    if max(agree) <= 1 and not _has_avx512():
        # measured 2026-12-06 on an AMD EPYC host with AVX2 only: vLLM-CPU 0.32's W8A8 int8 forward parts from
        # compressed-tensors' reference at the first or second token of every prompt (agree [0, 1, 1, 0, 1, 0] of 32;
        # the same code passed on AVX-512 hosts), so the two τ count different token streams
        pytest.xfail(f"vLLM-CPU's int8 kernels without AVX-512 are not the reference's: greedy agrees for {agree}")
    assert abs(ours["acceptance_length"] - vllm["acceptance_length"]) <= 0.05 * vllm["acceptance_length"]


def _has_avx512() -> bool:
    """Whether this host's CPU has AVX-512 (vLLM-CPU's int8 kernels take another path without it)."""
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True

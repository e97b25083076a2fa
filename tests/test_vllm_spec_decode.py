"""The exported drafter in real vLLM (CPU, fp32, eager): it loads, serves, and the acceptance vLLM reports on its
/metrics counters agrees with the in-process evaluator's on the same prompts, max_tokens and greedy decoding.

One vLLM server start (module fixture). The drafter is trained here by the real pipeline (embedded generate →
extract → train) on the target's own greedy answers to a few prompts, so it accepts many tokens on exactly those
prompts: the agreement check runs on them (through the evaluator's functions; the evaluate stage itself refuses
prompts the drafter was trained on). The evaluate stage then runs with the server as its live endpoint on held-out
MT-bench prompts, and its report carries both measurements.

Tolerance: services/evaluator/specdec.py reproduces vLLM's chain proposer, verifier and counting, so in fp32 the
two agree exactly unless a near-tie argmax flips between vLLM's and PyTorch's kernels. The tests assert
|τ_in-process − τ_vLLM| ≤ 5 % of τ_vLLM and per-position acceptance within 0.05, and print the exact numbers.
"""
from __future__ import annotations

import json

import pytest

from eyas.drafter import load_drafter
from eyas.embedded import Embedded
from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, bundled_target_dir, load_target
from services.evaluator.live import generate
from services.evaluator.specdec import eval_prompts, evaluate
from services.trainer.core import CPU_PRESET
from tests.servers import vllm_server
from tests.test_evaluator import PROMPTS, local_path, write_prompts

pytestmark = pytest.mark.vllm

K = 3
MAX_TOKENS = 48
TAU_TOLERANCE = 0.05  # relative
POS_TOLERANCE = 0.05  # absolute, per position


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("eyas-vllm-spec")
    prompts = write_prompts(work / "prompts.jsonl", PROMPTS)
    emb = Embedded(Settings(workdir=work / "eyas"))
    jobs = emb.run_job("generate", {
        "prompts": str(prompts), "max_turns": 1, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
        "then": ["extract", {"stage": "train", **CPU_PRESET, "steps": 40, "warmup": 5, "val_interval": 0}],
    })
    assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.stage, j.error) for j in jobs]
    return emb, jobs[-1].artifacts["output"], prompts


@pytest.fixture(scope="module")
def served(trained):
    _, drafter, _ = trained
    spec_config = {"method": "eagle3", "model": str(local_path(drafter) / "eagle"), "num_speculative_tokens": K}
    with vllm_server(bundled_target_dir(), speculative_config=spec_config) as url:
        yield url


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
    ours = evaluate(target, d, layout.aux_layers, prompts, K, MAX_TOKENS)
    vllm = generate(served, prompts, MAX_TOKENS, counters=True)

    # the drafter loaded and served every request, and both produce the target's own greedy output
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    assert vllm["outputs"] == [p["output"] for p in ours["per_prompt"]]
    # a drafter that actually accepts tokens, so the comparison means something
    assert ours["accepted"] > 0 and vllm["accepted"] > 0
    agree(ours, vllm)


def test_evaluate_stage_reports_vllm_acceptance_beside_its_own(trained, served):
    emb, drafter, _ = trained
    [job] = emb.run_job("evaluate", {"drafter": drafter, "num_prompts": 3, "k": K, "max_new_tokens": 32,
                                     "spec_endpoint": served})
    assert job.state == "succeeded", job.error
    report = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))
    ours, vllm = report["in_process"], report["live"]["speculative"]
    assert report["prompts"]["source"] == "bundled:mt_bench"
    assert ours["matches_greedy"] and vllm["matches_in_process_greedy"] and vllm["tokens"] == ours["tokens"]
    assert vllm["drafts"] == ours["drafts"] > 0
    agree(ours, vllm)
    assert job.metrics["live_acceptance_length"] == vllm["acceptance_length"]

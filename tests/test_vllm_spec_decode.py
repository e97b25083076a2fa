"""The exported drafter in real vLLM (CPU, fp32, eager): it loads, serves, and the acceptance vLLM reports on its
/metrics counters agrees with the in-process evaluator's on the same prompts, max_tokens and greedy decoding.

One vLLM server start. The drafter is trained here by the real pipeline (embedded generate → extract → train) on
the target's own greedy answers to a few prompts, so it accepts tokens on them; the evaluate stage then decodes
the same prompts in-process and through the server (its live A/B path) and writes both into one report.

Tolerance: vLLM's chain proposer and verifier are what services/evaluator/specdec.py reproduces (same counting,
same alignment), so in fp32 the two agree exactly unless a near-tie argmax flips between vLLM's and PyTorch's
kernels. The test asserts |τ_in-process − τ_vLLM| ≤ 5 % of τ_vLLM and per-position acceptance within 0.05, and
reports the exact numbers.
"""
from __future__ import annotations

import json

import pytest

from eyas.embedded import Embedded
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import bundled_target_dir
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


def test_exported_drafter_serves_in_vllm_and_acceptance_agrees(trained):
    emb, drafter, prompts = trained
    eagle = local_path(drafter) / "eagle"
    spec_config = {"method": "eagle3", "model": str(eagle), "num_speculative_tokens": K}
    with vllm_server(bundled_target_dir(), speculative_config=spec_config) as url:
        [job] = emb.run_job("evaluate", {"drafter": drafter, "prompts": str(prompts), "num_prompts": len(PROMPTS),
                                         "k": K, "max_new_tokens": MAX_TOKENS, "spec_endpoint": url})
    assert job.state == "succeeded", job.error
    report = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))
    ours, vllm = report["in_process"], report["live"]["speculative"]
    print(f"\nτ in-process {ours['acceptance_length']:.4f} {ours['per_position_acceptance']} "
          f"({ours['drafts']} drafts, {ours['accepted']} accepted)\n"
          f"τ vLLM       {vllm['acceptance_length']:.4f} {vllm['per_position_acceptance']} "
          f"({vllm['drafts']} drafts, {vllm['accepted']} accepted); vLLM {vllm['tok_s']:.1f} tok/s")

    # the drafter loaded and served every request, with the target's own greedy output
    assert vllm["tokens"] == ours["tokens"] and vllm["matches_in_process_greedy"]
    assert ours["matches_greedy"], ours["greedy_mismatches"]
    # a drafter that actually accepts tokens, so the comparison means something
    assert ours["accepted"] > 0 and vllm["accepted"] > 0
    assert abs(ours["acceptance_length"] - vllm["acceptance_length"]) <= TAU_TOLERANCE * vllm["acceptance_length"]
    for a, b in zip(ours["per_position_acceptance"], vllm["per_position_acceptance"], strict=True):
        assert abs(a - b) <= POS_TOLERANCE
    assert report["acceptance_length"] == ours["acceptance_length"]
    assert job.metrics["live_acceptance_length"] == vllm["acceptance_length"]

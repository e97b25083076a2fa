"""Any number of aux layers: features with 4 aux layers (any ascending ids) train, export, evaluate and serve in real
vLLM-CPU. The count travels in the layout from extraction to serving; nothing assumes 3 (the default layout, which
every other test trains on).

The layout (3, 10, 20, 26) of the bundled 30-layer target does not start at out(1): SGLang versions disagree on its
ids' offset, so the export marks SGLang unsupported (with the reason) and the evaluator checks vLLM's wiring only.
"""
from __future__ import annotations

import json

import pytest

from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.methods import load_drafter
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, bundled_target_dir, load_target
from orchestration.embedded import EmbeddedRunner
from services.evaluator.live import timed_completions
from services.evaluator.specdec import eval_prompts, measure_acceptance
from services.trainer.spec import CPU_PRESET
from tests.servers import vllm_starting
from tests.test_evaluator import local_path
from tests.test_vllm_spec_decode import agree

K = 3
MAX_TOKENS = 32
AUX = (3, 10, 20, 26)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, bundled_features):
    """Trained on the session's bundled_features conversations (tests/conftest.py), extracted again with AUX."""
    work = tmp_path_factory.mktemp("eyas-aux")
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[tmp_path_factory.getbasetemp()]))
    jobs = emb.run_job("extract", {"data": bundled_features.dataset, "aux_layers": list(AUX), "then": [
        {"stage": "train", **CPU_PRESET, "steps": 30, "warmup": 5, "val_interval": 0}]})
    assert [j.state for j in jobs] == ["succeeded"] * 2, [(j.stage, j.error) for j in jobs]
    return emb, jobs[-1].artifacts["output"], bundled_features.prompts, AUX


def test_trains_exports_and_evaluates(drafter):
    emb, uri, _, aux = drafter
    manifest = read_manifest(open_artifact(uri), kind="drafter")
    assert Layout.from_dict(manifest.layout).aux_layers == aux
    eagle = json.loads((local_path(uri) / "eagle" / "config.json").read_text())
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]  # vLLM: input-to-layer numbering
    target = load_target(BUNDLED)
    d, _ = load_drafter(local_path(uri) / "eagle", target.model.get_input_embeddings().weight.detach())
    assert d.cfg.num_aux == len(aux) and d.fc.weight.shape[1] == len(aux) * target.hidden_size

    [job] = emb.run_job("evaluate", {"drafter": uri, "num_prompts": 1, "max_new_tokens": 16, "k": K,
                                     "second_prompts": None})
    assert job.state == "succeeded", job.error
    report = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))
    served = report["wiring"]["served"]
    assert served["vllm:eagle"] == served["vllm:speculators"] == [f"out({i})" for i in aux]
    assert set(manifest.drafter.unsupported_engines) == {"sglang"} and "sglang:eagle" not in served
    assert "PR #25454" in report["wiring"]["unsupported"]["sglang"]
    assert report["in_process"]["matches_greedy"] and report["in_process"]["drafts"] > 0


@pytest.mark.vllm
def test_vllm_serves_it_and_acceptance_agrees(drafter):
    """Served by vLLM-CPU: the 4-aux layout that does not start at out(1)."""
    _, uri, prompt_file, aux = drafter
    spec_config = {"method": "eagle3", "model": str(local_path(uri) / "eagle"), "num_speculative_tokens": K}
    with vllm_starting(bundled_target_dir(), speculative_config=spec_config) as server:  # starts while we decode
        target = load_target(BUNDLED)
        d, _ = load_drafter(local_path(uri) / "eagle", target.model.get_input_embeddings().weight.detach())
        prompts = eval_prompts(target.tokenizer, str(prompt_file))
        ours = measure_acceptance(target, d, aux, prompts, K, MAX_TOKENS)
        vllm = timed_completions(server.url(), prompts, MAX_TOKENS, counters=True)
    assert ours["matches_greedy"] and vllm["outputs"] == [p["output"] for p in ours["per_prompt"]]
    assert ours["accepted"] > 0 and vllm["accepted"] > 0  # trained on these prompts' answers: it accepts
    agree(ours, vllm)


def _every(n: int, period: int) -> list[str]:
    """Qwen3-Next's layer_types: a full-attention layer closing every `period` layers, linear attention between."""
    return ["full_attention" if i % period == period - 1 else "linear_attention" for i in range(n)]


def test_hybrid_targets_read_full_attention_outputs_and_the_layout_records_the_rule():
    from eyas.layout import ENGINE_DEFAULT, HYBRID_FULL_ATTENTION, REQUESTED, aux_layers_for

    # Qwen3-Next-80B (48 layers) and a 32-layer Qwen3.5: out(1), then the full-attention outputs nearest the
    # default's out(L//2-1) and out(L-4) (out(44) and out(28) are linear-attention outputs)
    assert aux_layers_for(48, _every(48, 4)) == ((1, 23, 43), HYBRID_FULL_ATTENTION)
    assert aux_layers_for(32, _every(32, 4)) == ((1, 15, 27), HYBRID_FULL_ATTENTION)
    # the tiny family's alternation; a tie (out(4) between out(3) and out(5), out(3) taken) goes to the free one
    assert aux_layers_for(8, _every(8, 2)) == ((1, 3, 5), HYBRID_FULL_ATTENTION)
    # too few full-attention layers besides out(1) and the last, no linear attention, no layer_types: the default
    for types in (_every(8, 4), ["sliding_attention", "full_attention"] * 4, None):
        assert aux_layers_for(8, types) == ((1, 3, 4), ENGINE_DEFAULT)
    assert aux_layers_for(8, _every(8, 2), [4, 1]) == ((1, 4), REQUESTED)
    layout = Layout(target="t", target_config_hash="c", tokenizer_hash="k", num_layers=8, hidden_size=4,
                    vocab_size=8, aux_layers=(1, 3, 5), aux_rule=HYBRID_FULL_ATTENTION)
    assert Layout.from_dict(layout.to_dict()).aux_rule == HYBRID_FULL_ATTENTION
    # a layout recorded before the rule was: the engines' default chose its layers (the only rule then)
    old = {k: v for k, v in layout.to_dict().items() if k != "aux_rule"}
    assert Layout.from_dict(old).aux_rule == ENGINE_DEFAULT and Layout.from_dict(old) == layout  # rule not compared

"""The speculators export names its verifier, and the speculators library's plain
`Eagle3DraftModel.from_pretrained(export)` loads it with no network (HF_HUB_OFFLINE=1), its forward equal to Eyas's.

The library (speculators 0.9.0) opens the verifier the export names when it loads the export: its config.json
(num_hidden_layers, to check the aux layer ids; hidden_size) and, from its safetensors, embed_tokens, lm_head and the
final norm (the frozen verifier_lm_head and verifier_norm of its training loss). With none named it asks the hub for
a model called "None". Offline it needs the verifier in the Hugging Face cache, as it is wherever the target was
downloaded: the test writes a tiny random Llama there under a hub id its config.json records as `_name_or_path`.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.defaults import SPECULATORS_DIR
from eyas.drafter import Drafter, DrafterConfig
from eyas.exports import export_drafter, speculators_verifier
from eyas.layout import Layout, default_aux_layers
from eyas.methods import get_method, load_drafter
from eyas.target import BUNDLED, BUNDLED_HUB_ID
from services.trainer.spec import Spec
from tests.servers import REPO, VLLM_PYTHON
from tests.test_families import assert_same_ttt_logits

HUB_ID = "eyas-tests/tiny-llama"
K = 3


def test_the_verifier_is_the_spec_name_else_the_targets_hub_id_never_a_path():
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert speculators_verifier(BUNDLED, llama) == {"name_or_path": BUNDLED_HUB_ID,
                                                    "architectures": ["LlamaForCausalLM"]}
    assert speculators_verifier("/models/t",
                                {**llama, "_name_or_path": "org/model-1.5B"})["name_or_path"] == "org/model-1.5B"
    for saved_as in ("/home/me/t", "./t", "../org/t", "org/t/sub", "", None):
        assert speculators_verifier("/models/t", {**llama, "_name_or_path": saved_as})["name_or_path"] is None
    assert speculators_verifier("/models/t", llama)["name_or_path"] is None
    assert speculators_verifier(BUNDLED, llama, "/srv/smollm2")["name_or_path"] == "/srv/smollm2"  # the spec's wins
    assert Spec(features="file:///f", verifier="org/t").verifier == "org/t"
    for bad in ("org/t\n", "org/\x00t", "", "o/" + "t" * 255):
        with pytest.raises(ValueError, match="verifier"):
            Spec(features="file:///f", verifier=bad)


def tiny_target_in_the_hub_cache(hub: Path) -> tuple[Path, dict]:
    """A tiny random Llama as `hf download` leaves it in the Hugging Face cache `hub`, its config recording the
    hub id; returns its snapshot directory (the target Eyas trains for) and its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    repo = hub / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    cfg = {**json.loads((snapshot / "config.json").read_text()), "_name_or_path": HUB_ID}
    (snapshot / "config.json").write_text(json.dumps(cfg))
    return snapshot, cfg


@pytest.mark.vllm  # the speculators library lives in the vLLM environment (its pins: scripts/install-vllm.sh)
def test_speculators_loads_the_export_offline_by_its_verifier_name(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    target, cfg = tiny_target_in_the_hub_cache(tmp_path / "hub")
    embed = AutoModelForCausalLM.from_pretrained(target).get_input_embeddings().weight.detach()
    L = cfg["num_hidden_layers"]
    layout = Layout(target=str(target), target_config_hash="c", tokenizer_hash="t", num_layers=L, hidden_size=64,
                    vocab_size=256, aux_layers=default_aux_layers(L), dtype="float32")
    torch.manual_seed(1)
    drafter = Drafter(DrafterConfig.from_target(AutoConfig.from_pretrained(target), 64, num_aux=3))
    drafter.set_vocab(torch.arange(0, 256, 4))
    weights = {**drafter.state_dict(), "embed_tokens.weight": embed}
    verifier = speculators_verifier(str(target), cfg)
    assert verifier["name_or_path"] == HUB_ID
    export_drafter(drafter.cfg, weights, layout, tmp_path / "out", "float32", verifier, K, get_method("eagle3"))
    export = tmp_path / "out" / SPECULATORS_DIR
    assert json.loads((export / "config.json").read_text())["speculators_config"]["verifier"] == verifier

    torch.manual_seed(2)
    T = 9
    aux, ids = torch.randn(1, T, 3 * 64), torch.randint(0, 256, (T,))
    shifted = [torch.cat([ids[1 + k:], ids.new_zeros(1 + k)])[None] for k in range(K)]  # x_{t+1+k} beside g_t
    save_file({"aux": aux, "input_ids": shifted[0]}, str(tmp_path / "in.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), HF_HOME=str(tmp_path / "hf-home"))
    # "-": the verifier the export names; the script loads it with the plain from_pretrained(export) first
    run = subprocess.run([str(VLLM_PYTHON), "-P", str(REPO / "tests" / "speculators_forward.py"), str(export), "-",
                          str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), str(K)],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(str(tmp_path / "out.safetensors"))
    assert theirs["aux_ids"].tolist() == layout.vllm_ids

    ours_drafter, _ = load_drafter(export, embed)  # THE loader, as the evaluator reads the export
    assert_same_ttt_logits(ours_drafter, aux, shifted, theirs, tol=1e-5)

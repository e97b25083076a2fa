"""Aux-layer capture: forward hooks on exactly the decoder layers the layout names, plus the final norm.

Hooks read the residual stream each layer returns, out(i) (= HF hidden_states[i+1]); no other layer's states are
kept, and the lm_head never runs (the base model is called, not the causal-LM wrapper).
"""
from __future__ import annotations

import contextlib

import torch

from eyas.layout import EMBED, Layout
from eyas.target import Target


@contextlib.contextmanager
def hooks(target: Target, aux_layers: tuple[int, ...]):
    captured: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            captured[name] = output[0] if isinstance(output, tuple) else output
        return hook

    base = target.model.model
    # EMBED (-1) is the embedding output; never index base.layers[-1] for it (that is the last layer).
    handles = [(base.embed_tokens if i == EMBED else base.layers[i]).register_forward_hook(keep(f"out{i}"))
               for i in aux_layers]
    handles.append(base.norm.register_forward_hook(keep("final")))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def capture(target: Target, layout: Layout, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """input_ids/attention_mask [B, T] (right-padded) → aux [B, T, n_aux·H] (ascending out(i)), final [B, T, H]."""
    with hooks(target, layout.aux_layers) as got:
        target.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    aux = torch.cat([got[f"out{i}"] for i in layout.aux_layers], dim=-1)
    return aux, got["final"]

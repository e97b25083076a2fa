"""Aux-layer capture: forward hooks on exactly the decoder layers the layout names, plus the final norm.

Hooks read the residual stream each layer returns, out(i) (= HF hidden_states[i+1]); no other layer's states are
kept, and the lm_head never runs (the base model is called, not the causal-LM wrapper). A `check` given to `capture`
runs before every decoder layer: a forward of a large batch takes many seconds on a CPU, and a cancel (it raises)
must not wait for its end.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from eyas.layout import EMBED, Layout
from eyas.target import Target


@contextlib.contextmanager
def hooks(target: Target, aux_layers: tuple[int, ...], check: Callable[[], None] | None = None):
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
    if check is not None:
        handles += [layer.register_forward_pre_hook(lambda *_: check()) for layer in base.layers]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def gather(got: dict[str, torch.Tensor], aux_layers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The hooked out(i) states [B, T, H] each, concatenated in ascending order on `device` → [B, T, n_aux·H].
    A target spread over GPUs leaves each layer's state on that layer's GPU: they meet on `device` first."""
    return torch.cat([got[f"out{i}"].to(device) for i in aux_layers], dim=-1)


@torch.inference_mode()
def capture(target: Target, layout: Layout, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            device: torch.device | None = None,
            check: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids/attention_mask [B, T] (right-padded, on any device) → aux [B, T, n_aux·H] (ascending out(i)),
    final [B, T, H], both on `device` (default: the target's input device); `check()` before every layer."""
    on = target.input_device
    device = on if device is None else device
    with hooks(target, layout.aux_layers, check) as got:
        target.model.model(input_ids=input_ids.to(on, non_blocking=True),
                           attention_mask=attention_mask.to(on, non_blocking=True), use_cache=False)
    return gather(got, layout.aux_layers, device), got["final"].to(device)

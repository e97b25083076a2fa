"""Aux-layer capture: forward hooks on exactly the decoder layers the layout names, plus the final norm.

Hooks read the residual stream each layer returns, out(i) (= HF hidden_states[i+1]); no other layer's states are
kept, and the lm_head never runs (the base model is called, not the causal-LM wrapper). A `check` given to `capture`
runs before every decoder layer: a forward of a large batch takes many seconds on a CPU, and a cancel (it raises)
must not wait for its end.

Every captured state is checked: one that is all zeros for a sample (`check_nonzero`) fails the extraction, naming
the layer and the target. No real residual stream or final-norm output is zero over a whole sample; an engine that
does not capture a layer does return zeros (vLLM's Qwen3-Next forward, before its fix, vllm-project/vllm#36527, left
the aux states unfilled), and a drafter trained on them learns nothing from them, silently.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eyas.layout import EMBED, Layout, describe
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


class ZeroState(ValueError):
    """A captured state is all zeros for a sample: the engine did not capture that layer."""


@dataclass(frozen=True)
class Captured:
    """What a capture's states are, to name them in its errors: the target and the aux layers (out(i), ascending)
    of aux [T, n_aux·H]; the final state follows them."""

    target: str
    aux_layers: tuple[int, ...]

    def check_nonzero(self, sample: str, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Raise ZeroState naming the first aux layer (or the final norm) whose state is zero on every token of
        `sample` (aux [n, n_aux·H], final [n, H])."""
        n = aux.shape[0]
        live = [*aux.reshape(n, len(self.aux_layers), -1).ne(0).any(dim=2).any(dim=0).tolist(),
                bool(final.ne(0).any())]
        if all(live):
            return
        names = [*describe(list(self.aux_layers)), "final norm"]
        dead = [name for name, ok in zip(names, live, strict=True) if not ok]
        raise ZeroState(f"sample {sample!r}: target {self.target!r} captured all-zero states at {', '.join(dead)} "
                        f"(the engine did not capture that layer)")

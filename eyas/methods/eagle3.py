"""EAGLE-3: a one-layer drafter that drafts a chain, one forward per draft token (eyas.drafter), exported in the
EAGLE/SpecForge layout and the speculators format (eyas.exports); vLLM serves it with method "eagle3", SGLang too."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.defaults import EAGLE_DIR, NORM_FLAGS, SPECULATORS_DIR
from eyas.methods.base import DraftingMethod

if TYPE_CHECKING:
    import torch

    from eyas.batching import Batch
    from eyas.drafter import Drafter, DrafterConfig
    from eyas.layout import Layout
    from eyas.ttt import TTTResult


def drafter_config(target: str, draft_vocab_size: int, layout: Layout, **architecture: bool) -> DrafterConfig:
    """The drafter for `target`, concatenating as many aux layers as the features' layout names; `architecture`,
    DrafterConfig.from_target's (EAGLE 3.1's flags, P-EAGLE's `parallel`)."""
    from transformers import AutoConfig

    from eyas.drafter import DrafterConfig
    from eyas.target import resolve_target

    return DrafterConfig.from_target(AutoConfig.from_pretrained(resolve_target(target)), draft_vocab_size,
                                     num_aux=len(layout.aux_layers), **architecture)


def build_drafter(target: str, draft_vocab_size: int, layout: Layout, embed: torch.Tensor,
                  used: torch.Tensor, **architecture: bool) -> Drafter:
    """A fresh drafter: the target's frozen embedding, the draft vocabulary, PyTorch's default init elsewhere
    (seeded by the caller), as EAGLE and SpecForge start; `architecture`, as drafter_config takes it."""
    import torch

    from eyas.drafter import Drafter

    drafter = Drafter(drafter_config(target, draft_vocab_size, layout, **architecture))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
        drafter.set_vocab(used)
    return drafter


class Eagle3(DraftingMethod):
    name = "eagle3"
    title = "EAGLE-3"
    summary = "a chain, one drafter step per drafted token"
    export_dirs = (EAGLE_DIR, SPECULATORS_DIR)
    served_dir = EAGLE_DIR
    served_by = (("vllm", EAGLE_DIR), ("vllm", SPECULATORS_DIR), ("sglang", EAGLE_DIR))
    parallel = False
    fixed_block = False
    packs = True  # eyas.ttt masks attention and labels by sample
    draft_vocab = True
    takes_norms = True
    several_layers = False
    # the speculators library's names for it (speculators_model_type and algorithm; its config's architecture)
    speculators_type, speculators_architecture = "eagle3", "Eagle3Speculator"

    def speculative_config(self, model: str, k: int) -> dict[str, Any]:
        return {"method": "eagle3", "model": model, "num_speculative_tokens": k}

    def architecture(self, spec: Any) -> dict[str, bool]:
        """The drafter's shape beyond the target's, as DrafterConfig.from_target takes it: the spec's EAGLE 3.1
        flags, and whether it drafts in parallel (P-EAGLE's mask slots)."""
        return {**{k: getattr(spec, k) for k in NORM_FLAGS}, "parallel": self.parallel}

    def build(self, spec: Any, target: str, layout: Layout, embed: torch.Tensor, head: torch.Tensor,
              used: torch.Tensor | None) -> Drafter:
        assert used is not None, "draft_vocab: the trainer selects the draft vocabulary's ids for EAGLE-3"
        return build_drafter(target, spec.draft_vocab_size, layout, embed, used, **self.architecture(spec))

    def objective(self, drafter: Drafter, batch: Batch, target_lm_head: torch.Tensor, steps: int, decay: float,
                  recompute: bool, generator: torch.Generator | None) -> TTTResult:
        from eyas.ttt import ttt_forward

        return ttt_forward(drafter, batch, target_lm_head, steps, decay, recompute)

    def export(self, spec: Any, target: str, layout: Layout, weights: dict[str, torch.Tensor], head: torch.Tensor,
               out: Path, verifier: dict[str, Any]) -> tuple[list[Path], dict[str, str]]:
        from eyas.exports import export_drafter

        cfg = drafter_config(target, spec.draft_vocab_size, layout, **self.architecture(spec))
        return export_drafter(cfg, weights, layout, out, spec.dtype, verifier, spec.ttt_steps, self)

    def load(self, path: Path, config: dict[str, Any], embed_weight: torch.Tensor, dtype: torch.dtype,
             overrides: dict[str, Any] | None, missing_vocab_map: bool, lm_head_weight: torch.Tensor | None) -> Drafter:
        from eyas.exports import load_eagle

        return load_eagle(path, config, embed_weight, dtype, overrides, missing_vocab_map)

    def replay_runs(self, drafter: Drafter, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor,
                    prompt_len: int, k_max: int) -> list[int]:
        from eyas.drafter import chain_runs

        return chain_runs(drafter, ids, aux, preds, prompt_len, k_max)

    def draft_step(self, drafter: Drafter, batch: int, context: int) -> tuple[int, Callable[[], None]]:
        from eyas.drafter import chain_step

        return batch, chain_step(drafter, batch, context)  # a token per sequence

    def context_states(self, drafter: Drafter, aux: torch.Tensor) -> torch.Tensor:
        return drafter.project(aux)  # fc(g)

    def propose(self, drafter: Drafter, states: torch.Tensor, context: list[int], k: int,
                past: Any) -> tuple[list[int], Any]:
        from eyas.drafter import chain_drafts

        return chain_drafts(drafter, states, context, k, past)

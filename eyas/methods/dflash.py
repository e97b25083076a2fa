"""DFlash: a stack of draft_layers decoder layers that drafts a block of ttt_steps tokens in one forward, conditioned
on the features' target layers (eyas.dflash); exported as vLLM's DFlashDraftModel, served with method "dflash"."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.methods.base import DraftingMethod

if TYPE_CHECKING:
    import torch

    from eyas.batching import Batch
    from eyas.dflash import DFlashDrafter
    from eyas.layout import Layout
    from eyas.ttt import TTTResult

DFLASH_DIR = "dflash"
# DFlash blocks trained per sequence (random anchors in its supervised region; SpecForge samples them the same way)
DFLASH_ANCHORS = 16


def build_dflash(target: str, spec: Any, layout: Layout, embed: torch.Tensor, head: torch.Tensor) -> DFlashDrafter:
    """A fresh DFlash drafter (eyas.dflash): the spec's draft layers (default DFlash.layers), a block of ttt_steps
    drafts after the bonus token, conditioned on the features' target layers; the target's embedding and lm_head,
    frozen; the mask token one the tokenizer never produces from text."""
    from transformers import AutoConfig

    from eyas.dflash import DFlashConfig, DFlashDrafter, pick_mask_token
    from eyas.target import load_tokenizer, resolve_target

    cfg = DFlashConfig.from_target(AutoConfig.from_pretrained(resolve_target(target)),
                                   num_layers=spec.draft_layers or DFlash.layers, block_size=spec.ttt_steps + 1,
                                   target_layer_ids=layout.aux_layers,
                                   mask_token_id=pick_mask_token(load_tokenizer(target)))
    drafter = DFlashDrafter(cfg)
    drafter.set_target_head(embed, head)
    return drafter


class DFlash(DraftingMethod):
    name = "dflash"
    title = "DFlash"
    summary = ("a stack of draft_layers decoder layers that drafts a block of ttt_steps tokens in one forward, "
               "conditioned on the features' target layers (vLLM's method \"dflash\")")
    export_dirs = (DFLASH_DIR,)
    served_dir = DFLASH_DIR
    served_by = (("vllm", DFLASH_DIR),)
    parallel = True
    fixed_block = True
    # its blocks start at DFLASH_ANCHORS random anchors per row and attend over the row: packed, a sample would get
    # a share of its row's anchors and see its neighbours, so DFlash trains on a sample per row
    packs = False
    draft_vocab = False  # the target's whole vocabulary: it drafts with the target's lm_head
    takes_norms = False
    several_layers = True
    layers = 2  # the drafts of one forward need some depth
    refused_engines = {"sglang": "the export is vLLM's DFlashDraftModel; Eyas has not checked SGLang's DFlash "
                                 "loader against it"}

    def reads(self, config: dict[str, Any]) -> bool:
        from eyas.dflash import ARCHITECTURE

        return ARCHITECTURE in (config.get("architectures") or [])

    def owns(self, net: Any) -> bool:
        from eyas.dflash import DFlashDrafter

        return isinstance(net, DFlashDrafter)

    def speculative_config(self, model: str, k: int) -> dict[str, Any]:
        return {"method": "dflash", "model": model, "num_speculative_tokens": k}

    def build(self, spec: Any, target: str, layout: Layout, embed: torch.Tensor, head: torch.Tensor,
              used: torch.Tensor | None) -> DFlashDrafter:
        return build_dflash(target, spec, layout, embed, head)

    def objective(self, drafter: DFlashDrafter, batch: Batch, target_lm_head: torch.Tensor, steps: int,
                  decay: float, recompute: bool, generator: torch.Generator | None) -> TTTResult:
        """DFLASH_ANCHORS blocks a sequence at random anchors drawn from `generator` (the block fixes the positions
        drafted: `steps`, `decay` and `recompute` are the chain's)."""
        from eyas.dflash import dflash_objective

        return dflash_objective(drafter, batch, DFLASH_ANCHORS, generator)

    def export(self, spec: Any, target: str, layout: Layout, weights: dict[str, torch.Tensor], head: torch.Tensor,
               out: Path, verifier: dict[str, Any]) -> tuple[list[Path], dict[str, str]]:
        """dflash/ (vLLM's DFlashDraftModel) for the trained weights (with the target's embedding) and the target's
        lm_head `head`; the verifier is the speculators format's, which DFlash has none of."""
        from eyas.dflash import export_dflash

        drafter = build_dflash(target, spec, layout, weights["embed_tokens.weight"], head)
        restored = {k: v for k, v in weights.items() if k in drafter.trainable_state_dict()}
        drafter.load_state_dict(restored, strict=False)
        files = export_dflash(drafter, out / DFLASH_DIR, spec.dtype, layout.to_dict())
        return [f.relative_to(out) for f in files], dict(self.refused_engines)

    def load(self, path: Path, config: dict[str, Any], embed_weight: torch.Tensor, dtype: torch.dtype,
             overrides: dict[str, Any] | None, missing_vocab_map: bool,
             lm_head_weight: torch.Tensor | None) -> DFlashDrafter:
        from eyas.dflash import load_dflash

        if lm_head_weight is None:
            raise ValueError(f"{path}: a DFlash drafter drafts with the target's lm_head: give lm_head_weight")
        return load_dflash(path, embed_weight, lm_head_weight, dtype)

    def drafted_ks(self, drafter: DFlashDrafter, k_max: int) -> list[int]:
        """Only its block's K (its block attends within itself: a block of another size is another forward, which
        it was not trained for and vLLM would run as such)."""
        return [drafter.cfg.block_size - 1]

    def replay_runs(self, drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor,
                    prompt_len: int, k_max: int) -> list[int]:
        """Its block's K = block − 1 tokens whatever k_max is (eyas.dflash.block_runs)."""
        from eyas.dflash import block_runs

        return block_runs(drafter, ids, aux, preds, prompt_len)

    def draft_step(self, drafter: DFlashDrafter, batch: int, context: int) -> tuple[int, Callable[[], None]]:
        """A round at `batch`: a block's worth of new context states (the engine caches the older ones) and the block
        of [bonus token, masks], to the draft token ids; its block − 1 drafts a sequence."""
        from eyas.dflash import block_step

        return batch * (drafter.cfg.block_size - 1), block_step(drafter, batch)

    def context_states(self, drafter: DFlashDrafter, aux: torch.Tensor) -> torch.Tensor:
        return aux  # it drafts from the aux states themselves

    def propose(self, drafter: DFlashDrafter, states: torch.Tensor, context: list[int], k: int,
                past: Any) -> tuple[list[int], Any]:
        """A block per forward: the last token is the bonus, the rows before it the context (block_drafts)."""
        import torch

        from eyas.dflash import block_drafts

        on = states.device
        return block_drafts(drafter, torch.tensor([context], device=on), states,
                            torch.tensor([len(context) - 1]), k)[0].tolist(), None

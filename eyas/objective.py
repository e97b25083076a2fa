"""THE training objective of a drafter, whatever its kind: the training-time test of an EAGLE-3 or P-EAGLE drafter
(eyas.ttt), DFlash's block loss (eyas.dflash). The trainer's loss and validation and the evaluator's teacher-forced
accuracy all call `objective`, so each kind is trained and measured by one function."""
from __future__ import annotations

import torch

from eyas.batching import Batch
from eyas.dflash import DFlashDrafter, dflash_objective
from eyas.drafter import Drafter
from eyas.ttt import TTTResult, ttt_forward

# DFlash blocks trained per sequence (random anchors in its supervised region; SpecForge samples them the same way)
DFLASH_ANCHORS = 16


def objective(drafter: Drafter | DFlashDrafter, batch: Batch, target_lm_head: torch.Tensor, steps: int,
              decay: float = 0.8, recompute: bool = False, generator: torch.Generator | None = None) -> TTTResult:
    """The loss terms and per-position accuracy counts of `drafter` on `batch`: `steps` TTT steps (EAGLE-3, P-EAGLE;
    `decay` per step, `recompute` the draft-vocabulary logits in the backward pass), or DFlash's blocks at
    DFLASH_ANCHORS random anchors a sequence drawn from `generator` (its block fixes the positions drafted)."""
    if isinstance(drafter, DFlashDrafter):
        return dflash_objective(drafter, batch, DFLASH_ANCHORS, generator)
    return ttt_forward(drafter, batch, target_lm_head, steps, decay, recompute)

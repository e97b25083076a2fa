"""THE training objective of a drafter, whatever its method: the training-time test of an EAGLE-3 or P-EAGLE drafter
(eyas.ttt), DFlash's block loss (eyas.dflash), each its method's (eyas.methods). The trainer's loss and validation
and the evaluator's teacher-forced accuracy all call `objective`, so each method is trained and measured by one
function."""
from __future__ import annotations

from typing import Any

import torch

from eyas.batching import Batch
from eyas.methods import method_of_drafter
from eyas.ttt import TTTResult


def objective(drafter: Any, batch: Batch, target_lm_head: torch.Tensor, steps: int,
              decay: float = 0.8, recompute: bool = False, generator: torch.Generator | None = None) -> TTTResult:
    """The loss terms and per-position accuracy counts of `drafter` on `batch`: `steps` TTT steps (EAGLE-3, P-EAGLE;
    `decay` per step, `recompute` the draft-vocabulary logits in the backward pass), or DFlash's blocks at random
    anchors drawn from `generator` (its block fixes the positions drafted)."""
    return method_of_drafter(drafter).objective(drafter, batch, target_lm_head, steps, decay, recompute, generator)

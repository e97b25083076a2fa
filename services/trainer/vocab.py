"""The draft vocabulary (docs/eagle3.md §5): the Vd target ids the drafter can propose.

1. Count each token id where loss_mask == 1, over the TRAIN samples only (validation stays unseen).
2. Keep the Vd most frequent ids, ties broken by the lower id (order (-count, id), as speculators does). When fewer
   than Vd distinct ids occur, the same order pads with the lowest unused ids (all have count 0).
3. Sort the kept ids ascending: draft id i is the i-th smallest kept target id. `Drafter.set_vocab` turns this into
   d2t (int64 offsets, target id = i + d2t[i]) and t2d (bool mask over the target vocabulary).

Default size: 8192 (V/6 for the bundled SmolLM2 target, V = 49152). The lm_head costs Vd·H per token and TTT step,
so Vd trades speed for coverage: on the bundled target's data every id that occurs fits in 8192, and 4096 covers
nearly all supervised tokens (the CPU preset: a smaller head). Coverage per size:
bench/README.md § Trainer CPU preset. SpecForge's default of 32000 is sized for 128k-vocabulary targets.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from eyas.features import Sample


def token_counts(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """[V] int64: how often each target id occurs at a supervised position (loss_mask == 1)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s.input_ids[s.loss_mask.bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The ascending [Vd] int64 target ids of the draft vocabulary (top-Vd by (-count, id)); Vd = min(requested, V),
    as DrafterConfig.from_target sizes the head (a small target's whole vocabulary, not an error)."""
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be at least 1")
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep ascending id order
    return order[:draft_vocab_size].sort().values


def coverage(counts: torch.Tensor, used: torch.Tensor) -> float:
    """Share of supervised tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[used].sum()) / total if total else 0.0

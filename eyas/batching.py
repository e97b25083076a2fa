"""Feature samples → right-padded batches under a padded-token budget: what the trainer's TTT loop and the
evaluator's teacher-forced accuracy both feed `eyas.ttt.ttt_forward`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.features import Sample


@dataclass
class Batch:
    """Right-padded tensors of B samples. Index t of a row is token t of its sample; padding follows `lengths`."""

    input_ids: torch.Tensor  # [B, T] int64, 0 on padding
    loss_mask: torch.Tensor  # [B, T] int64 0/1, 0 on padding
    lengths: torch.Tensor  # [B] int64
    aux_hidden: torch.Tensor  # [B, T, n_aux·H]
    final_hidden: torch.Tensor  # [B, T, H] target's final post-norm state (label source)
    target_top: torch.Tensor | None = None  # [B, T] int64 target full-vocab argmax, if precomputed

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> Batch:
        top = None if self.target_top is None else self.target_top.to(device)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
                     self.aux_hidden.to(device), self.final_hidden.to(device), top)


def collate(samples: list[Sample], tops: list[torch.Tensor] | None = None) -> Batch:
    """Right-pad samples into one Batch (features keep their stored dtype; ttt_forward casts them)."""
    lengths = torch.tensor([s.input_ids.numel() for s in samples], dtype=torch.int64)
    B, T = len(samples), int(lengths.max())
    first = samples[0]
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.int64)
    aux = torch.zeros(B, T, first.aux_hidden.shape[-1], dtype=first.aux_hidden.dtype)
    final = torch.zeros(B, T, first.final_hidden.shape[-1], dtype=first.final_hidden.dtype)
    for b, s in enumerate(samples):
        n = s.input_ids.numel()
        ids[b, :n], mask[b, :n] = s.input_ids, s.loss_mask
        aux[b, :n], final[b, :n] = s.aux_hidden, s.final_hidden
    top = None
    if tops is not None:
        top = torch.zeros(B, T, dtype=torch.int64)
        for b, t in enumerate(tops):
            top[b, : lengths[b]] = t
    return Batch(ids, mask, lengths, aux, final, top)


def cut_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Cut length-descending indices into batches of at most batch_tokens padded tokens (B · longest)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in indices:
        if cur and lengths[cur[0]] * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def eval_plan(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Validation batches: fixed order, longest first."""
    return cut_batches(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), lengths, batch_tokens)

"""Feature samples → right-padded batches under a padded-token budget: what the trainer's TTT loop and the
evaluator's teacher-forced accuracy both feed `eyas.ttt.ttt_forward`.

A row holds one sample (`collate`) or several packed one after the other (`collate_rows`, `pack_rows`): a packed
row carries each token's sample (`segments`) and its position inside that sample (`positions`, restarting at 0),
and the drafter attends only within a sample (eyas.ttt), so packing leaves every sample's loss as it was alone
while the padding that rows of unequal samples need mostly goes."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.features import Sample


@dataclass
class Batch:
    """Right-padded tensors of B rows. Without `segments` a row is one sample and index t its token t; padding
    follows `lengths` (a row's tokens, of all its samples)."""

    input_ids: torch.Tensor  # [B, T] int64, 0 on padding
    loss_mask: torch.Tensor  # [B, T] int64 0/1, 0 on padding
    lengths: torch.Tensor  # [B] int64
    aux_hidden: torch.Tensor  # [B, T, n_aux·H]
    final_hidden: torch.Tensor  # [B, T, H] target's final post-norm state (label source)
    target_top: torch.Tensor | None = None  # [B, T] int64 target full-vocab argmax, if precomputed
    # packed rows only (None: one sample per row): [B, T] int64 the token's sample within its row (0, 1, …; -1 on
    # padding), and its position inside that sample (0 at each sample's first token)
    segments: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device),
                     self.aux_hidden.to(device), self.final_hidden.to(device), move(self.target_top),
                     move(self.segments), move(self.positions))


def collate(samples: list[Sample], tops: list[torch.Tensor] | None = None) -> Batch:
    """Right-pad samples into one Batch, a row each (features keep their stored dtype; ttt_forward casts them)."""
    return collate_rows([[s] for s in samples], None if tops is None else [[t] for t in tops])


def collate_rows(rows: list[list[Sample]], tops: list[list[torch.Tensor]] | None = None) -> Batch:
    """Rows of samples, each row's samples one after the other, right-padded into one Batch; `tops`, the samples'
    precomputed target argmax in the same shape. A batch whose rows all hold one sample carries no segments."""
    samples = [s for row in rows for s in row]
    lengths = torch.tensor([sum(s.input_ids.numel() for s in row) for row in rows], dtype=torch.int64)
    B, T = len(rows), int(lengths.max())
    first = samples[0]
    ids = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.zeros(B, T, dtype=torch.int64)
    aux = torch.zeros(B, T, first.aux_hidden.shape[-1], dtype=first.aux_hidden.dtype)
    final = torch.zeros(B, T, first.final_hidden.shape[-1], dtype=first.final_hidden.dtype)
    top = torch.zeros(B, T, dtype=torch.int64) if tops is not None else None
    segments = torch.full((B, T), -1, dtype=torch.int64)
    positions = torch.zeros(B, T, dtype=torch.int64)
    for b, row in enumerate(rows):
        at = 0
        for j, s in enumerate(row):
            n = s.input_ids.numel()
            span = slice(at, at + n)
            ids[b, span], mask[b, span] = s.input_ids, s.loss_mask
            aux[b, span], final[b, span] = s.aux_hidden, s.final_hidden
            segments[b, span], positions[b, span] = j, torch.arange(n)
            if top is not None and tops is not None:
                top[b, span] = tops[b][j]
            at += n
    if all(len(row) == 1 for row in rows):
        return Batch(ids, mask, lengths, aux, final, top)
    return Batch(ids, mask, lengths, aux, final, top, segments, positions)


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


def pack_rows(indices: list[int], lengths: list[int], width: int) -> list[list[int]]:
    """First-fit packing of length-descending indices into rows of at most `width` tokens (first-fit decreasing; a
    sample longer than `width` fills a row alone). Rows come in the order they were opened, each in index order."""
    rows: list[list[int]] = []
    free: list[int] = []  # tokens left in each row
    for i in indices:
        n = lengths[i]
        r = next((r for r, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([i])
            free.append(width - n)
        else:
            rows[r].append(i)
            free[r] -= n
    return rows


def eval_plan(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Validation batches: fixed order, longest first."""
    return cut_batches(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), lengths, batch_tokens)

"""Training data: feature samples → right-padded batches under a token budget, in a deterministic, resumable order.

- Split: sample i (its order in the features artifact) is validation iff `eyas.features.is_validation(i, val_every)`.
- Order: epoch e shuffles the train samples with a generator seeded by (seed, e), groups them by length inside
  windows of `GROUP` samples (little padding), cuts batches of at most `batch_tokens` padded tokens (a longer
  sample forms a batch alone) and shuffles the batches. The same (seed, epoch, lengths, budget) give the same plan.
- Position: `DataPosition(epoch, index)` names the next batch; a checkpoint stores it and resume continues there.
- Data parallel: every rank walks the same global plan and takes its share of each batch (`shard`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.features import FeatureReader, Sample, is_validation

GROUP = 64  # samples sorted by length together before batches are cut


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
    top = torch.zeros(B, T, dtype=torch.int64) if tops is not None else None
    for b, s in enumerate(samples):
        n = s.input_ids.numel()
        ids[b, :n], mask[b, :n] = s.input_ids, s.loss_mask
        aux[b, :n], final[b, :n] = s.aux_hidden, s.final_hidden
        if top is not None:
            top[b, :n] = tops[b]
    return Batch(ids, mask, lengths, aux, final, top)


def split_samples(reader: FeatureReader, val_every: int) -> tuple[list[Sample], list[Sample]]:
    """(train, validation) samples of a features artifact, in artifact order."""
    train: list[Sample] = []
    val: list[Sample] = []
    for i, s in enumerate(reader.samples()):
        (val if is_validation(i, val_every) else train).append(s)
    return train, val


def _cut(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
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


def epoch_plan(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches (lists of sample indices) of one epoch; a pure function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for w in range(0, len(order), GROUP):
        window = sorted(order[w: w + GROUP], key=lambda i: (-lengths[i], i))
        batches += _cut(window, lengths, batch_tokens)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def eval_plan(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Validation batches: fixed order, longest first."""
    return _cut(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), lengths, batch_tokens)


def shard(batch: list[int], rank: int, world: int) -> tuple[list[int], bool]:
    """This rank's share of a global batch (round-robin over the length-sorted samples). A rank left without a
    sample gets the batch's first sample back with `real=False`: it must run it with zero weight, so every rank
    still takes part in the gradient all-reduce."""
    mine = batch[rank::world]
    return (mine, True) if mine else ([batch[0]], False)


@dataclass
class DataPosition:
    epoch: int = 0
    index: int = 0  # next batch of the epoch's plan


class BatchStream:
    """Endless sequence of global batches over the train samples, epoch after epoch, resumable by position."""

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int, position: DataPosition | None = None):
        if not lengths:
            raise ValueError("no training samples: the features hold only validation samples")
        self.lengths, self.batch_tokens, self.seed = lengths, batch_tokens, seed
        self.position = position or DataPosition()
        self._plan_epoch, self._plan = -1, []

    def _plan_for(self, epoch: int) -> list[list[int]]:
        if epoch != self._plan_epoch:
            self._plan_epoch, self._plan = epoch, epoch_plan(self.lengths, self.batch_tokens, self.seed, epoch)
        return self._plan

    def batches_per_epoch(self) -> int:
        return len(self._plan_for(self.position.epoch))

    def next(self) -> list[int]:
        plan = self._plan_for(self.position.epoch)
        if self.position.index >= len(plan):
            self.position = DataPosition(self.position.epoch + 1, 0)
            plan = self._plan_for(self.position.epoch)
        batch = plan[self.position.index]
        self.position = DataPosition(self.position.epoch, self.position.index + 1)
        return batch

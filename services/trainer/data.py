"""Training order: feature samples → global batches (eyas.batching) in a deterministic, resumable order.

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

from eyas.batching import cut_batches
from eyas.features import FeatureReader, Sample, is_validation

GROUP = 64  # samples sorted by length together before batches are cut


def split_samples(reader: FeatureReader, val_every: int) -> tuple[list[Sample], list[Sample]]:
    """(train, validation) samples of a features artifact, in artifact order."""
    train: list[Sample] = []
    val: list[Sample] = []
    for i, s in enumerate(reader.samples()):
        (val if is_validation(i, val_every) else train).append(s)
    return train, val


def epoch_plan(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches (lists of sample indices) of one epoch; a pure function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for w in range(0, len(order), GROUP):
        window = sorted(order[w: w + GROUP], key=lambda i: (-lengths[i], i))
        batches += cut_batches(window, lengths, batch_tokens)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


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

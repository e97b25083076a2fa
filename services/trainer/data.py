"""Training order: feature samples → global batches (eyas.batching) in a deterministic, resumable order.

- Split: sample i (its order in the features artifact) is validation iff `eyas.features.is_validation(i, val_every)`.
- Reading: the features stream through a bounded local cache (eyas.streaming): each epoch visits the shards in
  windows that fit half the cache, shuffled by (seed, epoch); where all of them fit, one window in artifact order.
- Order: within each window of epoch e, the window's train samples are shuffled with a generator seeded by
  (seed, window, e), grouped by length inside runs of `GROUP` samples (little padding), cut into batches of at most
  `batch_tokens` padded tokens (a longer sample forms a batch alone) and the batches shuffled; the epoch is its
  windows' batches one window after the other. The same (seed, epoch, lengths, windows, budget) give the same plan,
  and with one window it is a shuffle of every train sample with every other.
- Position: `DataPosition(epoch, index)` names the next batch; a checkpoint stores it and resume continues there.
- Data parallel: every rank walks the same global plan and takes its share of each batch (`shard`).
- Length: `total_steps`, the job's optimizer steps (`eyas run`'s planner counts them with it too).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas.batching import cut_batches
from eyas.features import Sample, is_validation, shard_bytes
from eyas.streaming import FeatureStream
from services.trainer.vocab import token_counts

GROUP = 64  # samples sorted by length together before batches are cut
WINDOW_SEED = 7_919  # window w of an epoch shuffles with seed + WINDOW_SEED · w
VAL_SHARE = 4  # validation samples kept in memory: at most this fraction of the cache's bytes

# epoch → the train samples (positions in the train list) of each window of that epoch, in reading order
Windows = Callable[[int], list[list[int]]]


@dataclass
class TrainData:
    """One scan of a features artifact (eyas.streaming.FeatureStream.scan): where its train samples are, what they
    hold, and the validation samples, kept in memory."""

    stream: FeatureStream
    train: list[int]  # sample index (artifact order) of each train sample
    lengths: list[int]  # their token counts
    val: list[Sample]  # copies, the first ones in artifact order that fit a VAL_SHARE of the cache
    val_total: int  # validation samples in the features (beyond those kept)
    counts: torch.Tensor  # [V] int64: supervised token ids over the train samples (the draft vocabulary's)
    _by_shard: dict[str, list[int]] = field(default_factory=dict)

    def windows(self, seed: int) -> Windows:
        if not self._by_shard:
            for position, index in enumerate(self.train):
                self._by_shard.setdefault(self.stream.shard_of(index), []).append(position)

        def of_epoch(epoch: int) -> list[list[int]]:
            return [sorted(p for name in window for p in self._by_shard.get(name, []))
                    for window in self.stream.windows(seed, epoch)]

        return of_epoch

    def enter(self, seed: int, epoch: int, w: int) -> None:
        """Load window w of `epoch`'s (see eyas.streaming.FeatureStream.enter), fetching the next one meanwhile."""
        self.stream.enter(self.stream.windows(seed, epoch), w, following=self.stream.windows(seed, epoch + 1)[0])

    def sample(self, position: int) -> Sample:
        return self.stream.sample(self.train[position])


def scan_features(stream: FeatureStream, val_every: int, vocab_size: int) -> TrainData:
    """Read every sample once (window by window): split train / validation, count the train samples' supervised
    token ids, and keep the first validation samples that fit."""
    train, lengths, val, val_total = [], [], [], 0
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    val_budget, val_bytes = stream.cache_bytes // VAL_SHARE, 0
    for index, s in stream.scan():
        if is_validation(index, val_every):
            val_total += 1
            size = shard_bytes(s.input_ids.numel(), s.aux_hidden.shape[-1] + s.final_hidden.shape[-1])
            if val_bytes + size <= val_budget:  # copies: a view would keep its whole shard in memory
                val.append(Sample(*(t.clone() for t in (s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden))))
                val_bytes += size
        else:
            train.append(index)
            lengths.append(s.input_ids.numel())
            counts += token_counts((s,), vocab_size)
    return TrainData(stream=stream, train=train, lengths=lengths, val=val, val_total=val_total, counts=counts)


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
    """Endless sequence of global batches over the train samples, epoch after epoch, resumable by position.
    `windows` says which train samples each window of an epoch holds (default: one window of them all);
    `window` is (epoch, window) of the batch `next` returned last."""

    def __init__(self, lengths: list[int], batch_tokens: int, seed: int, position: DataPosition | None = None,
                 windows: Windows | None = None):
        if not lengths:
            raise ValueError("no training samples: the features hold only validation samples")
        self.lengths, self.batch_tokens, self.seed = lengths, batch_tokens, seed
        self.windows = windows or (lambda _epoch: [list(range(len(lengths)))])
        self.position = position or DataPosition()
        self.window = (-1, -1)
        self._plan_epoch, self._plan = -1, []

    def _plan_for(self, epoch: int) -> list[tuple[int, list[int]]]:
        if epoch != self._plan_epoch:
            plan = []
            for w, members in enumerate(self.windows(epoch)):
                local = epoch_plan([self.lengths[i] for i in members], self.batch_tokens,
                                   self.seed + WINDOW_SEED * w, epoch)
                plan += [(w, [members[j] for j in batch]) for batch in local]
            self._plan_epoch, self._plan = epoch, plan
        return self._plan

    def batches_per_epoch(self) -> int:
        return len(self._plan_for(self.position.epoch))

    def next(self) -> list[int]:
        plan = self._plan_for(self.position.epoch)
        if self.position.index >= len(plan):
            self.position = DataPosition(self.position.epoch + 1, 0)
            plan = self._plan_for(self.position.epoch)
        w, batch = plan[self.position.index]
        self.window = (self.position.epoch, w)
        self.position = DataPosition(self.position.epoch, self.position.index + 1)
        return batch


def total_steps(lengths: list[int], batch_tokens: int, seed: int, epochs: float, steps: int | None = None,
                windows: Windows | None = None) -> int:
    """A train job's optimizer steps: `steps` when given, else `epochs` times the first epoch's batches over train
    samples of these lengths (read in these windows), rounded, at least one."""
    if steps:
        return steps
    return max(1, round(epochs * BatchStream(lengths, batch_tokens, seed, windows=windows).batches_per_epoch()))

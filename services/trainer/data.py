"""Training order: feature samples → global batches (eyas.batching) in a deterministic, resumable order.

- Split: sample i (its order in the features artifact) is validation iff `eyas.features.is_validation(i, val_every)`.
- Reading: the features stream through a bounded local cache (eyas.streaming): each epoch visits the shards in
  windows that fit half the cache, shuffled by (seed, epoch); where all of them fit, one window in artifact order.
- Order: within each window of epoch e, the window's train samples are shuffled with a generator seeded by
  (seed, window, e), grouped by length inside runs of `GROUP` samples (little padding), cut into batches of at most
  `batch_tokens` padded tokens (a longer sample forms a batch alone) and the batches shuffled; the epoch is its
  windows' batches one window after the other. A batch is a list of rows, a row a list of samples: one sample each,
  or, packed (`pack`), each run's samples first-fit into rows that split `batch_tokens` evenly, each at least
  twice the run's longest sample (attention is dense over a row: it costs at most a few times a padded batch's). The
  same (seed, epoch, lengths, windows, budget) give the same plan,
  and with one window it is a shuffle of every train sample with every other.
- Position: `DataPosition(epoch, index)` names the next batch; a checkpoint stores it and resume continues there.
- Data parallel: every rank walks the same global plan and takes its share of each batch's rows (`shard`).
- Length: `total_steps`, the job's optimizer steps (`eyas run`'s planner counts them with it too).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas.batching import cut_batches, pack_rows
from eyas.features import Sample, is_validation, shard_bytes, token_bytes
from eyas.streaming import FeatureStream

GROUP = 64  # samples sorted by length together before batches are cut
WINDOW_SEED = 7_919  # window w of an epoch shuffles with seed + WINDOW_SEED · w
VAL_SHARE = 4  # validation samples kept in memory: at most this fraction of the cache's bytes

# epoch → the train samples (positions in the train list) of each window of that epoch, in reading order
Windows = Callable[[int], list[list[int]]]
Rows = list[list[int]]  # a batch: its rows, each the samples laid one after the other in it


@dataclass
class TrainData:
    """A features artifact planned from its index (eyas.features.Index): where its train samples are and what they
    hold, without reading a feature. The validation samples are read later (`load_validation`)."""

    stream: FeatureStream
    train: list[int]  # sample index (artifact order) of each train sample
    lengths: list[int]  # their token counts
    val_indices: list[int]  # every validation sample's index
    counts: torch.Tensor  # [V] int64: supervised token ids over the train samples (the draft vocabulary's)
    val: list[Sample] = field(default_factory=list)  # in memory: see load_validation
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
        self.stream.enter(seed, epoch, w)

    def sample(self, position: int) -> Sample:
        return self.stream.sample(self.train[position])

    def load_validation(self, seed: int) -> list[Sample]:
        """The validation samples of epoch 0's first window, in artifact order, as many as fit a VAL_SHARE of the
        cache (copies: a view would keep its whole shard in memory). Where every shard fits one window these are
        the first validation samples of the artifact."""
        self.enter(seed, 0, 0)
        window = set(self.stream.windows(seed, 0)[0])
        budget, used, val = self.stream.cache_bytes // VAL_SHARE, 0, []
        for index in self.val_indices:
            if self.stream.shard_of(index) not in window:
                continue
            s = self.stream.sample(index)
            size = shard_bytes(s.input_ids.numel(), token_bytes(s.aux_hidden.shape[-1] + s.final_hidden.shape[-1]))
            if used + size > budget:
                break
            val.append(Sample(*(t.clone() for t in (s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden))))
            used += size
        return val


def plan_features(stream: FeatureStream, val_every: int, vocab_size: int) -> TrainData:
    """Split the artifact's samples into train / validation and count the train samples' supervised token ids,
    from its index alone (a features artifact still being extracted has one before its first shard)."""
    index = stream.reader.index()
    stream.set_starts(index.shard_starts.tolist())
    held_out = is_validation(torch.arange(len(index.offsets) - 1), val_every)  # [S] bool
    lengths = index.lengths
    train = (~held_out).nonzero().flatten().tolist()
    return TrainData(stream=stream, train=train, lengths=[lengths[i] for i in train],
                     val_indices=held_out.nonzero().flatten().tolist(),
                     counts=index.supervised_counts(~held_out, vocab_size))


def epoch_plan(lengths: list[int], batch_tokens: int, seed: int, epoch: int, pack: bool = False) -> list[Rows]:
    """The batches (rows of sample indices) of one epoch; a pure function of its arguments. `pack`: a batch
    holds R = batch_tokens // (2 · the run's longest sample) rows (one at least) of batch_tokens // R tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[Rows] = []
    for w in range(0, len(order), GROUP):
        window = sorted(order[w: w + GROUP], key=lambda i: (-lengths[i], i))
        if pack:
            # rows at least twice the run's longest sample (any two of its samples share one), batch_tokens
            # divided evenly between them, so a batch fills its budget; one row of a longer sample alone
            longest = lengths[window[0]]
            per = max(1, batch_tokens // (2 * longest))
            rows = pack_rows(window, lengths, max(longest, batch_tokens // per))
            batches += [rows[r: r + per] for r in range(0, len(rows), per)]
        else:
            batches += [[[i] for i in batch] for batch in cut_batches(window, lengths, batch_tokens)]
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def shard(batch: Rows, rank: int, world: int) -> tuple[Rows, bool]:
    """This rank's share of a global batch (round-robin over its rows, longest first). A rank left without a row
    gets the batch's first row back with `real=False`: it must run it with zero weight, so every rank still takes
    part in the gradient all-reduce."""
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
                 windows: Windows | None = None, pack: bool = False):
        if not lengths:
            raise ValueError("no training samples: the features hold only validation samples")
        self.lengths, self.batch_tokens, self.seed, self.pack = lengths, batch_tokens, seed, pack
        self.windows = windows or (lambda _epoch: [list(range(len(lengths)))])
        self.position = position or DataPosition()
        self.window = (-1, -1)
        self._plans: dict[int, list[tuple[int, Rows]]] = {}  # epoch → plan: the current and the next

    def _plan_for(self, epoch: int) -> list[tuple[int, Rows]]:
        if epoch not in self._plans:
            plan = []
            for w, members in enumerate(self.windows(epoch)):
                local = epoch_plan([self.lengths[i] for i in members], self.batch_tokens,
                                   self.seed + WINDOW_SEED * w, epoch, self.pack)
                plan += [(w, [[members[j] for j in row] for row in batch]) for batch in local]
            self._plans[epoch] = plan
            if len(self._plans) > 2:  # an epoch boundary looks one epoch ahead (`upcoming`); older plans go
                del self._plans[min(e for e in self._plans if e != epoch)]
        return self._plans[epoch]

    def batches_per_epoch(self, epoch: int | None = None) -> int:
        return len(self._plan_for(self.position.epoch if epoch is None else epoch))

    def upcoming(self) -> tuple[int, int]:
        """(epoch, window) of the batch `next` returns next."""
        plan = self._plan_for(self.position.epoch)
        if self.position.index >= len(plan):
            return self.position.epoch + 1, self._plan_for(self.position.epoch + 1)[0][0]
        return self.position.epoch, plan[self.position.index][0]

    def next(self) -> Rows:
        plan = self._plan_for(self.position.epoch)
        if self.position.index >= len(plan):
            self.position = DataPosition(self.position.epoch + 1, 0)
            plan = self._plan_for(self.position.epoch)
        w, batch = plan[self.position.index]
        self.window = (self.position.epoch, w)
        self.position = DataPosition(self.position.epoch, self.position.index + 1)
        return batch


def total_steps(lengths: list[int], batch_tokens: int, seed: int, epochs: float, steps: int | None = None,
                windows: Windows | None = None, pack: bool = False) -> int:
    """A train job's optimizer steps: `steps` when given, else the batches of `epochs` epochs over train samples of
    these lengths (read in these windows, packed or not): every batch of each whole epoch, and the fraction of the
    next one's, rounded; at least one."""
    if steps:
        return steps
    batches = BatchStream(lengths, batch_tokens, seed, windows=windows, pack=pack)
    whole = int(epochs)
    n = sum(batches.batches_per_epoch(e) for e in range(whole))
    if epochs > whole:
        n += round((epochs - whole) * batches.batches_per_epoch(whole))
    return max(1, n)

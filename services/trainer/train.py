"""The training loop, in plain sight: AdamW (0.9, 0.95), linear warmup + cosine decay, gradient clipping at 0.5,
validation every `val_interval` steps, checkpoints every `checkpoint_every` steps, exact resume.

One process, or several under torchrun (DDP; gloo on CPU, nccl on GPUs): every rank walks the same global batch
plan and trains on its share of each batch. Each rank scales its summed loss by world / (masked positions of the
whole global batch), so the all-reduced gradient is the single-process gradient of the same global batch.

Checkpoints (services.trainer.checkpoint) let a resumed run continue exactly where it stopped.

Run under torchrun:  torchrun --nproc_per_node 2 -m services.trainer.train --spec SPEC.json --output URI
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from eyas.batching import collate_rows, eval_plan
from eyas.deadline import Deadline, Pace
from eyas.device import placement
from eyas.features import FeatureReader, Sample
from eyas.layout import Layout
from eyas.methods import get_method
from eyas.objective import objective
from eyas.ranks import emit
from eyas.settings import Settings, get_settings
from eyas.store import Artifact, open_artifact
from eyas.streaming import FeatureStream
from eyas.target import load_target_head
from eyas.ttt import label_rows, target_top
from services.trainer.checkpoint import (
    load_validation,
    restore,
    resume_source,
    save_checkpoint,
    save_validation,
)
from services.trainer.data import BatchStream, DataPosition, TrainData, plan_features, shard, total_steps
from services.trainer.inputs import open_features, resolve
from services.trainer.spec import Spec
from services.trainer.vocab import coverage, select_vocab
from services.trainer.warm import warm_start

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 0.5
WEIGHT_DECAY = 0.0
LOSS_DECAY = 0.8  # weight 0.8^k of TTT step k (EAGLE, SpecForge)
PROGRESS_TAG = "EYAS-TRAIN-PROGRESS "  # a rank-0 stdout line a parent process turns into job progress
# Spec fields a resumed run may change; every other field must equal the checkpoint's.
RESUME_MAY_CHANGE = ("resume", "then", "processes", "checkpoint_every", "activation_checkpointing", "verifier",
                     "finish_by")

OnProgress = Callable[[int, int, dict[str, Any]], None]  # (step, total steps, metrics)


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to `peak`, then cosine decay to 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# A deadline's schedule changes only when the steps that fit move by more than this share of it: a learning rate that
# follows every step time's jitter would wobble for nothing.
RESIZE_SHARE = 0.02


def steps_that_fit(step: int, most: int, left_s: float, step_s: float, reserve_s: float) -> int:
    """The total steps of a run at `step` with `left_s` seconds to its deadline, a step taking `step_s` and the end
    (last validation, checkpoint, exports) `reserve_s`: at most `most`, never fewer than the steps done (at least
    one)."""
    more = math.floor((left_s - reserve_s) / step_s) if step_s > 0 else most
    return max(step, 1, min(most, step + max(0, more)))


def resized_total(total: int, fitted: int, step: int) -> int:
    """The schedule's total after a re-fit: `fitted` when it moved past RESIZE_SHARE of `total`, or when the run must
    stop now; else `total` unchanged."""
    if fitted <= step or abs(fitted - total) > max(1, RESIZE_SHARE * total):
        return fitted
    return total


class TrainingObjective(nn.Module):
    """The drafter plus its objective (eyas.objective: TTT, or DFlash's blocks) as one module, so DDP wraps a plain
    forward. The target lm_head is a plain attribute: frozen, never broadcast, never in a state dict."""

    def __init__(self, drafter: Any, target_lm_head: torch.Tensor, steps: int,
                 recompute: bool = False, seed: int = 0):
        super().__init__()
        self.drafter = drafter
        self.target_lm_head = target_lm_head
        self.steps = steps
        self.recompute = recompute  # activation checkpointing of the draft-vocabulary logits
        self.seed = seed

    def forward(self, batch, step: int = 0, rank: int = 0):
        # DFlash's anchors: drawn from (seed, step, rank), so a resumed run draws what the uninterrupted one drew
        generator = torch.Generator().manual_seed(hash((self.seed, step, rank)) & 0x7FFF_FFFF)
        return objective(self.drafter, batch, self.target_lm_head, self.steps, LOSS_DECAY, self.recompute, generator)


@dataclass
class TrainingSetup:
    """What the loop needs, built once from the spec and the features."""

    layout: Layout
    data: TrainData  # the train samples (read through the bounded cache) and the validation samples
    drafter: Any
    target_lm_head: torch.Tensor
    vocab_coverage: float
    total_steps: int


def training_fields(spec: Spec) -> dict[str, Any]:
    return {k: v for k, v in spec.model_dump(mode="json").items() if k not in RESUME_MAY_CHANGE}


def _check_stream(spec: Spec, reader: FeatureReader) -> None:
    """A hand-off's windows must fit the trainer's cache twice over (the window read and the next)."""
    if reader.stream is not None and 2 * reader.stream.window_bytes > spec.cache_gb * (1 << 30):
        raise ValueError(f"cache_gb={spec.cache_gb:g} is smaller than the features stream's max_store_gb="
                         f"{2 * reader.stream.window_bytes / (1 << 30):g}: the trainer holds two of its windows")


def _check_epochs(spec: Spec, data: TrainData, total: int) -> None:
    """An extractor that recomputes produces its own count of epochs: the training must fit them."""
    available = data.stream.epochs_available()
    if available is None:
        return
    batches = BatchStream(data.lengths, spec.batch_tokens, spec.seed, windows=data.windows(spec.seed),
                          pack=_packs(spec))
    if total > sum(batches.batches_per_epoch(e) for e in range(available)):
        raise ValueError(f"{total} steps need more than the {available} epochs the features stream extracts "
                         f"(extract spec stream.epochs): raise it, or train fewer steps or epochs")


def prepare(spec: Spec, layout: Layout, reader: FeatureReader, settings: Settings | None = None) -> TrainingSetup:
    _check_stream(spec, reader)
    stream = FeatureStream(reader, int(spec.cache_gb * (1 << 30)))
    data = plan_features(stream, spec.val_every, layout.vocab_size)
    if not data.train:
        raise ValueError(f"features {spec.features}: no training samples (val_every={spec.val_every})")
    target = spec.target or layout.target
    embed, head = load_target_head(target)
    torch.manual_seed(spec.seed)
    method = get_method(spec.method)
    # a method without a draft vocabulary drafts from the target's whole one (DFlash: with the target's lm_head)
    used = select_vocab(data.counts, spec.draft_vocab_size) if method.draft_vocab else None
    drafter = method.build(spec, target, layout, embed, head, used)
    if spec.init_from:  # its weights and draft vocabulary replace the fresh ones
        warm_start(spec, layout, drafter, embed, head, settings or get_settings())
        used = drafter.t2d.nonzero().flatten() if used is not None and hasattr(drafter, "t2d") else used
    vocab_coverage = coverage(data.counts, used) if used is not None else 1.0
    total = total_steps(data.lengths, spec.batch_tokens, spec.seed, spec.epochs, spec.steps, data.windows(spec.seed),
                        _packs(spec))
    _check_epochs(spec, data, total)
    return TrainingSetup(layout=layout, data=data, drafter=drafter, target_lm_head=head,
                         vocab_coverage=vocab_coverage, total_steps=total)


class TargetTopCache:
    """Full-vocabulary target argmax per sample, computed once on first use (it costs a V-wide matmul) and kept
    until `clear()` (when the samples it covers leave memory)."""

    def __init__(self, sample: Callable[[int], Sample], lm_head: torch.Tensor):
        self.sample, self.lm_head = sample, lm_head
        self.tops: dict[int, torch.Tensor] = {}

    def batch(self, rows: list[list[int]], device):
        """The Batch of these rows of samples (eyas.batching.collate_rows), their target argmax included."""
        on = self.lm_head.device
        samples = [[self.sample(i) for i in row] for row in rows]
        for i, s in zip((i for row in rows for i in row), (s for row in samples for s in row), strict=True):
            if i not in self.tops:
                self.tops[i] = target_top(s.final_hidden.to(on), self.lm_head, label_rows(s.loss_mask).to(on)).cpu()
        return collate_rows(samples, [[self.tops[i] for i in row] for row in rows]).to(device)

    def clear(self) -> None:
        self.tops.clear()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _packs(spec: Spec) -> bool:
    """Packed batches on one process only (Spec.packed): a torchrun launch may have more ranks than its spec's
    `processes`, and ranks share a batch by rows."""
    return spec.packed and _rank_world()[1] == 1


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a CPU tensor over ranks (through the GPU when the backend is nccl)."""
    if not dist.is_initialized():
        return t
    x = t.cuda() if dist.get_backend() == "nccl" else t
    dist.all_reduce(x)
    return x.cpu()


def _autocast(spec: Spec, device: torch.device):
    """bf16 autocast over fp32 weights and optimizer state (the trainer resolved spec.dtype from "auto")."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16")


def _deadline_total(total: int, most: int, step: int, deadline: Deadline, step_s: float, val_s: float) -> int:
    """The schedule's total at `step` against the deadline (rank 0's, so that every rank stops at the same step)."""
    rank, _ = _rank_world()
    fitted = resized_total(total, steps_that_fit(step, most, deadline.left(), step_s, val_s + 2 * step_s), step)
    fitted = int(_all_sum(torch.tensor([fitted if rank == 0 else 0], dtype=torch.int64))[0])
    if fitted != total:
        log.info("deadline in %.0f s at %.2f s a step: %d steps in all (was %d)", deadline.left(), step_s, fitted,
                 total)
    return fitted


@dataclass
class Counts:
    """What the objective counted, summed over batches and ranks: the weighted objective and its denominator (masked
    positions), per TTT step the cross-entropy sum, the correct top-1 predictions and the positions counted, and the
    tokens trained on. Float64 on the CPU."""

    objective: torch.Tensor
    denom: torch.Tensor
    ce_sum: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor
    tokens: torch.Tensor

    @classmethod
    def zeros(cls, k: int) -> Counts:
        return cls(*(torch.zeros(n, dtype=torch.float64) for n in (1, 1, k, k, k, 1)))

    @classmethod
    def of(cls, r: Any, tokens: int = 0, weight: float = 1.0) -> Counts:
        """One objective result's counts (`r`: eyas.objective's), times `weight` (0 for a rank's padding batch)."""
        parts = [p.detach().reshape(-1).double() for p in (r.objective, r.denom, r.ce_sum, r.correct, r.count)]
        parts.append(torch.tensor([float(tokens)], dtype=torch.float64, device=parts[0].device))
        return cls(*(torch.cat(parts).cpu() * weight).split([p.numel() for p in parts]))  # one copy off the GPU

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def all_sum(self) -> Counts:
        """Summed over the ranks, in one all-reduce."""
        parts = [getattr(self, f.name) for f in fields(self)]
        return Counts(*_all_sum(torch.cat(parts)).split([p.numel() for p in parts]))

    @property
    def positions(self) -> float:
        """The objective's denominator (at least 1)."""
        return float(self.denom.clamp(min=1))

    @property
    def loss(self) -> float:
        return float(self.objective) / self.positions

    @property
    def acc(self) -> list[float]:
        """Top-1 accuracy per TTT step."""
        return (self.correct / self.count.clamp(min=1)).tolist()


@torch.no_grad()
def validate(spec: Spec, setup: TrainingSetup, tops: TargetTopCache, device) -> dict[str, Any]:
    rank, world = _rank_world()
    plan = eval_plan([s.input_ids.numel() for s in setup.data.val], spec.batch_tokens)
    counts = Counts.zeros(spec.ttt_steps)
    setup.drafter.eval()
    for indices in plan[rank::world]:
        with _autocast(spec, device):  # DFlash's anchors: the same for every validation (a fixed seed)
            rows = [[i] for i in indices]  # validation: a sample per row, measured as it always was
            r = objective(setup.drafter, tops.batch(rows, device), setup.target_lm_head, spec.ttt_steps,
                          LOSS_DECAY, generator=torch.Generator().manual_seed(indices[0]))
        counts += Counts.of(r)
    setup.drafter.train()
    counts = counts.all_sum()
    return {"loss": counts.loss, "acc": counts.acc}


@dataclass
class _Training:
    """One rank's training run: the drafter, its optimizer and data, where it stands, and its record (history and
    info go into every checkpoint)."""

    spec: Spec
    setup: TrainingSetup
    device: torch.device
    head: torch.Tensor
    optimizer: torch.optim.Optimizer
    names: list[str]  # of the trained parameters, as checkpoints store them
    fields: dict[str, Any]  # the spec's fields a resumed run must match
    output: Artifact
    source: Artifact | None  # the checkpoint resumed from
    step: int
    position: DataPosition
    history: dict[str, list]
    info: dict[str, Any] = field(default_factory=dict)
    val_s: float = 0.0  # seconds of the last validation pass (a deadline keeps time for the one at the end)
    window: tuple | None = None  # the window of shards the last batch came from

    @property
    def data(self) -> TrainData:
        return self.setup.data

    @property
    def releases(self) -> bool:
        """The features are deleted as training consumes them."""
        return bool(self.data.stream.releases)

    def validate(self, tops: TargetTopCache) -> None:
        v0 = time.perf_counter()
        self.history["val"].append({"step": self.step, **validate(self.spec, self.setup, tops, self.device)})
        self.val_s = time.perf_counter() - v0

    def checkpoint(self, position: DataPosition) -> None:
        save_checkpoint(self.output, self.step, self.setup.drafter, self.optimizer, self.names, position,
                        self.history, self.fields, self.info)

    def next_batch(self, stream: BatchStream, tops: TargetTopCache, rank: int) -> list[list[int]]:
        """The next global batch, entering its window of shards (and fetching the one after meanwhile) when it is a
        new one."""
        if self.releases and self.window is not None and stream.upcoming() != self.window:
            # leaving a window whose shards are deleted once used: commit a checkpoint past it first, so a crash
            # never needs a deleted shard (only rank 0 writes; every rank has left the window)
            if rank == 0:
                self.checkpoint(stream.position)
                self.data.stream.release_before(self.spec.seed, *stream.upcoming())
        global_batch = stream.next()
        if stream.window != self.window:
            self.window = stream.window
            self.data.enter(self.spec.seed, *self.window)
            if not self.data.stream.whole:
                tops.clear()
        return global_batch


def _open(spec: Spec, layout: Layout, reader: FeatureReader, output: Artifact, settings: Settings,
          device: torch.device) -> _Training:
    """The run on `device`: set up from the spec and the features, resumed where a checkpoint says, its validation
    samples loaded."""
    setup = prepare(spec, layout, reader, settings)
    drafter = setup.drafter.to(device)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=spec.lr, betas=BETAS,
                                  weight_decay=WEIGHT_DECAY)
    run = _Training(spec, setup, device, setup.target_lm_head.to(device), optimizer, names, training_fields(spec),
                    output, resume_source(spec, output, settings), 0, DataPosition(), {"train": [], "val": []})
    if run.source is not None:
        run.step, run.position, run.history = restore(run.source, drafter, optimizer, names, run.fields)
        log.info("resuming from %s at step %d", run.source.uri, run.step)
    # Where the features are deleted as training consumes them, the validation samples are kept with the
    # checkpoints: a resumed run reads them there, not from shards that may be gone.
    data = setup.data
    data.val = (load_validation(run.source) if run.source is not None else None) or data.load_validation(spec.seed)
    if len(data.val) < len(data.val_indices):
        log.warning("validating on %d of %d validation samples (those of the first window that fit a quarter of "
                    "cache_gb=%g)", len(data.val), len(data.val_indices), spec.cache_gb)
    rank, world = _rank_world()
    if run.releases and rank == 0:
        save_validation(output, data.val)
    run.info = {"total_steps": setup.total_steps, "train_samples": len(data.train), "val_samples": len(data.val),
                "vocab_coverage": setup.vocab_coverage, "device": str(device), "processes": world,
                "feature_windows": len(data.stream.windows(spec.seed, 0))}
    return run


def _optimize(run: _Training, model: nn.Module, batch: Any, real: bool, total: int) -> tuple[Counts, float]:
    """One optimizer step on this rank's share of a global batch (`real`: not a padding one): the whole batch's
    counts, and the learning rate."""
    rank, world = _rank_world()
    lr = lr_at(run.step, total, run.spec.warmup, run.spec.lr)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with _autocast(run.spec, run.device):
        r = model(batch, run.step, rank)
    weight = 1.0 if real else 0.0
    counts = Counts.of(r, batch.num_tokens, weight).all_sum()
    (r.objective * (weight * world / counts.positions)).backward()
    torch.nn.utils.clip_grad_norm_([p for g in run.optimizer.param_groups for p in g["params"]], MAX_GRAD_NORM)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return counts, lr


def train(spec: Spec, layout: Layout, reader: FeatureReader, output: Artifact, report: OnProgress,
          settings: Settings) -> None:
    """Train (or continue training) to the spec's total steps, checkpointing into `output`; the last checkpoint
    (step == total) holds the result. Every rank of a torchrun job calls this."""
    rank, world = _rank_world()
    device = placement(settings, spec.dtype).device  # this rank's GPU (LOCAL_RANK), or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    run = _open(spec, layout, reader, output, settings, device)
    data = run.data
    tops_train, tops_val = TargetTopCache(data.sample, run.head), TargetTopCache(data.val.__getitem__, run.head)
    if run.step == 0 and data.val:  # where training starts from, for the record
        run.validate(tops_val)
    model = TrainingObjective(run.setup.drafter, run.head, spec.ttt_steps, spec.activation_checkpointing, spec.seed)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    stream = BatchStream(data.lengths, spec.batch_tokens, spec.seed, run.position, data.windows(spec.seed),
                         _packs(spec))
    total, start = run.setup.total_steps, run.step
    schedule = _Schedule(total, Deadline(spec.finish_by), Pace())  # a deadline only shortens the spec's steps
    if run.releases and rank == 0 and run.step < total:  # windows a run before this one finished (it may have
        data.stream.release_before(spec.seed, *stream.upcoming())  # crashed between its checkpoint and the deletion)
    bar = tqdm(total=total, initial=run.step, desc="train", unit="step", disable=True if rank else None)
    schedule.pace.mark()
    while run.step < schedule.total:
        t0 = time.perf_counter()
        global_batch = run.next_batch(stream, tops_train, rank)
        mine, real = shard(global_batch, rank, world)
        counts, lr = _optimize(run, model, tops_train.batch(mine, device), real, schedule.total)
        run.history["train"].append({"step": run.step, "loss": counts.loss, "acc": counts.acc, "lr": lr,
                                     "tokens_per_s": float(counts.tokens) / (time.perf_counter() - t0),
                                     # what each step trained on: its epoch, and its samples' indices in artifact order
                                     "epoch": stream.window[0],
                                     "samples": [data.train[p] for row in global_batch for p in row]})
        _after_step(run, schedule, tops_val, stream.position)
        bar.total = schedule.total
        bar.update(1)
        bar.set_postfix(loss=f"{counts.loss:.3f}", acc0=f"{counts.acc[0]:.3f}")
        if rank == 0:
            report(run.step, schedule.total, _metrics(run))
    bar.close()
    if run.releases and rank == 0:  # the final checkpoint is committed: nothing read so far is needed again
        data.stream.release_before(spec.seed, *stream.upcoming())
    if rank == 0 and run.source is not None and run.source is not output and run.step == start:
        # a finished run resumed from another artifact (e.g. one trained across nodes): its last checkpoint is
        # this job's result
        run.checkpoint(stream.position)
    if dist.is_initialized():
        dist.barrier()


@dataclass
class _Schedule:
    """The run's total steps, which a deadline shortens from the pace of the steps so far."""

    total: int
    deadline: Deadline
    pace: Pace  # seconds per step (its validations included)


def _after_step(run: _Training, schedule: _Schedule, tops_val: TargetTopCache, position: DataPosition) -> None:
    """A step's validation (every val_interval, and the last), its re-fit to the deadline, and its checkpoint."""
    spec, step, (rank, _) = run.spec, run.step, _rank_world()
    if run.data.val and (spec.val_interval and step % spec.val_interval == 0 or step == schedule.total):
        run.validate(tops_val)
    if schedule.deadline and step < schedule.total:
        schedule.pace.mark()
        if schedule.pace.known:
            schedule.total = _deadline_total(schedule.total, run.setup.total_steps, step, schedule.deadline,
                                             schedule.pace.seconds(), run.val_s)
            if step == schedule.total and run.data.val and run.history["val"][-1]["step"] != step:
                run.validate(tops_val)  # stopped: the last validation
        run.info["total_steps"] = schedule.total
    if rank == 0 and (step % spec.checkpoint_every == 0 or step == schedule.total):
        run.checkpoint(position)


def _metrics(run: _Training) -> dict[str, Any]:
    """The progress a step reports: its training loss, accuracy and speed, and the last validation's."""
    entry = run.history["train"][-1]
    metrics = {"step": run.step, "loss": entry["loss"], "acc": entry["acc"], "tokens_per_s": entry["tokens_per_s"]}
    if run.history["val"]:
        metrics.update(val_loss=run.history["val"][-1]["loss"], val_acc=run.history["val"][-1]["acc"])
    return metrics


def main(argv: list[str] | None = None) -> None:
    """Entry point for torchrun (or a plain process): train a spec into an output artifact; rank 0 prints
    progress lines for the parent. The parent then exports the final checkpoint."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="trainer spec as JSON")
    p.add_argument("--output", required=True, help="output artifact URI (checkpoints go under it)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    settings = get_settings()  # this process (a torchrun rank) reads the worker's environment
    spec = resolve(Spec.model_validate_json(args.spec), settings)  # as a job's parent does (not there across nodes)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if placement(settings, spec.dtype).device.type == "cuda" else "gloo")
    try:
        reader, layout = open_features(spec, settings)

        def report(step: int, total: int, metrics: dict[str, Any]) -> None:
            emit(PROGRESS_TAG + json.dumps({"step": step, "total": total, "metrics": metrics}))

        train(spec, layout, reader, open_artifact(args.output, settings), report, settings)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

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
from dataclasses import dataclass
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

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 0.5
WEIGHT_DECAY = 0.0
LOSS_DECAY = 0.8  # weight 0.8^k of TTT step k (EAGLE, SpecForge)
PROGRESS_TAG = "EYAS-TRAIN-PROGRESS "  # a rank-0 stdout line a parent process turns into job progress
# Spec fields a resumed run may change; every other field must equal the checkpoint's.
RESUME_MAY_CHANGE = ("resume", "then", "processes", "checkpoint_every", "activation_checkpointing", "verifier",
                     "finish_by")

Report = Callable[[int, int, dict[str, Any]], None]  # (step, total steps, metrics)


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


class TTTObjective(nn.Module):
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
                          pack=spec.packed)
    if total > sum(batches.batches_per_epoch(e) for e in range(available)):
        raise ValueError(f"{total} steps need more than the {available} epochs the features stream extracts "
                         f"(extract spec stream.epochs): raise it, or train fewer steps or epochs")


def prepare(spec: Spec, layout: Layout, reader: FeatureReader) -> TrainingSetup:
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
    vocab_coverage = coverage(data.counts, used) if used is not None else 1.0
    total = total_steps(data.lengths, spec.batch_tokens, spec.seed, spec.epochs, spec.steps, data.windows(spec.seed),
                        spec.packed)
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


@torch.no_grad()
def validate(spec: Spec, setup: TrainingSetup, tops: TargetTopCache, device) -> dict[str, Any]:
    rank, world = _rank_world()
    plan = eval_plan([s.input_ids.numel() for s in setup.data.val], spec.batch_tokens)
    K = spec.ttt_steps
    stats = torch.zeros(2 + 3 * K, dtype=torch.float64)  # objective, denom, ce[K], correct[K], count[K]
    setup.drafter.eval()
    for indices in plan[rank::world]:
        with _autocast(spec, device):  # DFlash's anchors: the same for every validation (a fixed seed)
            rows = [[i] for i in indices]  # validation: a sample per row, measured as it always was
            r = objective(setup.drafter, tops.batch(rows, device), setup.target_lm_head, K, LOSS_DECAY,
                          generator=torch.Generator().manual_seed(indices[0]))
        stats += torch.cat([r.objective.reshape(1), r.denom.reshape(1), r.ce_sum, r.correct, r.count]).double().cpu()
    setup.drafter.train()
    stats = _all_sum(stats)
    denom, correct, count = stats[1].clamp(min=1), stats[2 + K: 2 + 2 * K], stats[2 + 2 * K:].clamp(min=1)
    return {"loss": float(stats[0] / denom), "acc": (correct / count).tolist()}


def train(spec: Spec, layout: Layout, reader: FeatureReader, output: Artifact, report: Report, settings: Settings) -> None:
    """Train (or continue training) to the spec's total steps, checkpointing into `output`; the last checkpoint
    (step == total) holds the result. Every rank of a torchrun job calls this."""
    rank, world = _rank_world()
    device = placement(settings, spec.dtype).device  # this rank's GPU (LOCAL_RANK), or the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    setup = prepare(spec, layout, reader)
    drafter = setup.drafter.to(device)
    head = setup.target_lm_head.to(device)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    fields = training_fields(spec)
    data = setup.data
    step, position, history = 0, DataPosition(), {"train": [], "val": []}
    source = resume_source(spec, output, settings)
    if source is not None:
        step, position, history = restore(source, drafter, optimizer, names, fields)
        log.info("resuming from %s at step %d", source.uri, step)
    # Where the features are deleted as training consumes them, the validation samples are kept with the
    # checkpoints: a resumed run reads them there, not from shards that may be gone.
    releases = data.stream.releases
    data.val = (load_validation(source) if source is not None else None) or data.load_validation(spec.seed)
    if len(data.val) < len(data.val_indices):
        log.warning("validating on %d of %d validation samples (those of the first window that fit a quarter of "
                    "cache_gb=%g)", len(data.val), len(data.val_indices), spec.cache_gb)
    if releases and rank == 0:
        save_validation(output, data.val)
    info = {"total_steps": setup.total_steps, "train_samples": len(data.train), "val_samples": len(data.val),
            "vocab_coverage": setup.vocab_coverage, "device": str(device), "processes": world,
            "feature_windows": len(data.stream.windows(spec.seed, 0))}

    tops_train, tops_val = TargetTopCache(data.sample, head), TargetTopCache(data.val.__getitem__, head)
    val_s = 0.0  # seconds of the last validation pass (a deadline keeps time for the one at the end)
    if step == 0 and data.val:  # where training starts from, for the record
        v0 = time.perf_counter()
        history["val"].append({"step": 0, **validate(spec, setup, tops_val, device)})
        val_s = time.perf_counter() - v0
    model = TTTObjective(drafter, head, spec.ttt_steps, spec.activation_checkpointing, spec.seed)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    windows = data.windows(spec.seed)
    stream = BatchStream(data.lengths, spec.batch_tokens, spec.seed, position, windows, spec.packed)
    total, K, start = setup.total_steps, spec.ttt_steps, step
    most = total  # the spec's steps: a deadline only shortens the run
    deadline, pace = Deadline(spec.finish_by), Pace()  # seconds per step (its validations included)
    window = None
    if releases and rank == 0 and step < total:  # windows a run before this one finished (it may have crashed
        data.stream.release_before(spec.seed, *stream.upcoming())  # between its checkpoint and the deletion)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=True if rank else None)
    pace.mark()
    while step < total:
        t0 = time.perf_counter()
        if releases and window is not None and stream.upcoming() != window:
            # leaving a window whose shards are deleted once used: commit a checkpoint past it first, so a crash
            # never needs a deleted shard (only rank 0 writes; every rank has left the window)
            if rank == 0:
                save_checkpoint(output, step, drafter, optimizer, names, stream.position, history, fields, info)
                data.stream.release_before(spec.seed, *stream.upcoming())
        global_batch = stream.next()
        if stream.window != window:  # the next window of shards: load it, fetch the one after meanwhile
            window = stream.window
            data.enter(spec.seed, *window)
            if not data.stream.whole:
                tops_train.clear()
        mine, real = shard(global_batch, rank, world)
        batch = tops_train.batch(mine, device)
        lr = lr_at(step, total, spec.warmup, spec.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with _autocast(spec, device):
            r = model(batch, step, rank)
        weight = 1.0 if real else 0.0
        stats = torch.cat([r.objective.detach().reshape(1), r.denom.reshape(1), r.ce_sum, r.correct, r.count,
                           torch.tensor([float(batch.num_tokens)], device=r.count.device)]).double() * weight
        stats = _all_sum(stats.cpu())
        denom = float(stats[1].clamp(min=1))
        (r.objective * (weight * world / denom)).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        elapsed = time.perf_counter() - t0
        acc = (stats[2 + K: 2 + 2 * K] / stats[2 + 2 * K: 2 + 3 * K].clamp(min=1)).tolist()
        entry = {"step": step, "loss": float(stats[0]) / denom, "acc": acc, "lr": lr,
                 "tokens_per_s": float(stats[-1]) / elapsed,
                 # what each step trained on: its epoch, and its samples' indices in artifact order
                 "epoch": stream.window[0], "samples": [data.train[p] for row in global_batch for p in row]}
        history["train"].append(entry)
        if data.val and (spec.val_interval and step % spec.val_interval == 0 or step == total):
            v0 = time.perf_counter()
            history["val"].append({"step": step, **validate(spec, setup, tops_val, device)})
            val_s = time.perf_counter() - v0
        if deadline and step < total:
            pace.mark()
            if pace.known:
                total = _deadline_total(total, most, step, deadline, pace.seconds(), val_s)
                if step == total and data.val and history["val"][-1]["step"] != step:  # stopped: the last validation
                    history["val"].append({"step": step, **validate(spec, setup, tops_val, device)})
            info["total_steps"] = bar.total = total
        if rank == 0 and (step % spec.checkpoint_every == 0 or step == total):
            save_checkpoint(output, step, drafter, optimizer, names, stream.position, history, fields, info)
        bar.update(1)
        bar.set_postfix(loss=f"{entry['loss']:.3f}", acc0=f"{acc[0]:.3f}")
        if rank == 0:
            metrics = {"step": step, "loss": entry["loss"], "acc": acc, "tokens_per_s": entry["tokens_per_s"]}
            if history["val"]:
                metrics.update(val_loss=history["val"][-1]["loss"], val_acc=history["val"][-1]["acc"])
            report(step, total, metrics)
    bar.close()
    if releases and rank == 0:  # the final checkpoint is committed: nothing read so far is needed again
        data.stream.release_before(spec.seed, *stream.upcoming())
    if rank == 0 and source is not None and source is not output and step == start:
        # a finished run resumed from another artifact (e.g. one trained across nodes): its last checkpoint is
        # this job's result
        save_checkpoint(output, step, drafter, optimizer, names, stream.position, history, fields, info)
    if dist.is_initialized():
        dist.barrier()


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
            print(PROGRESS_TAG + json.dumps({"step": step, "total": total, "metrics": metrics}), flush=True)

        train(spec, layout, reader, open_artifact(args.output, settings), report, settings)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

"""The training loop, in plain sight: AdamW (0.9, 0.95), linear warmup + cosine decay, gradient clipping at 0.5,
validation every `val_interval` steps, checkpoints every `checkpoint_every` steps, exact resume.

One process, or several under torchrun (DDP; gloo on CPU, nccl on GPUs): every rank walks the same global batch
plan and trains on its share of each batch. Each rank scales its summed loss by world / (masked positions of the
whole global batch), so the all-reduced gradient is the single-process gradient of the same global batch.

Checkpoints live under the job's output prefix (rank 0 writes them; no pickle anywhere):
  checkpoints/step-NNNNNNNN/model.safetensors      drafter weights without the frozen embedding, plus d2t/t2d
  checkpoints/step-NNNNNNNN/optimizer.safetensors  AdamW exp_avg / exp_avg_sq / step per parameter, RNG state
  checkpoints/step-NNNNNNNN/state.json             step, data position, history, the spec fields that shape training
  checkpoints/latest.json                          written last: the commit marker of a checkpoint
Resume loads all of it and continues with exactly the losses an uninterrupted run would have had. The final
checkpoint (step == total steps) is what the stage exports.

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
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn
from tqdm import tqdm

from eyas.drafter import Drafter, DrafterConfig
from eyas.features import FeatureReader, Sample
from eyas.layout import Layout
from eyas.settings import Settings, get_settings
from eyas.store import Artifact, open_artifact
from eyas.target import load_target_head, resolve_target
from services.trainer.data import BatchStream, DataPosition, collate, eval_plan, shard, split_samples
from services.trainer.ttt import label_rows, target_top, ttt_forward
from services.trainer.vocab import coverage, select_vocab, token_counts

log = logging.getLogger(__name__)

BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 0.5
WEIGHT_DECAY = 0.0
LOSS_DECAY = 0.8  # weight 0.8^k of TTT step k (EAGLE, SpecForge)
ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")
CHECKPOINTS = "checkpoints"
LATEST = f"{CHECKPOINTS}/latest.json"
PROGRESS_TAG = "EYAS-TRAIN-PROGRESS "  # a rank-0 stdout line a parent process turns into job progress
# Spec fields a resumed run may change; every other field must equal the checkpoint's.
RESUME_MAY_CHANGE = ("resume", "then", "processes", "checkpoint_every")

Report = Callable[[int, int, dict[str, Any]], None]  # (step, total steps, metrics)


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to `peak`, then cosine decay to 0."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class TTTObjective(nn.Module):
    """The drafter plus its TTT loss as one module, so DDP wraps a plain forward. The target lm_head is a plain
    attribute: frozen, never broadcast, never in a state dict."""

    def __init__(self, drafter: Drafter, target_lm_head: torch.Tensor, steps: int):
        super().__init__()
        self.drafter = drafter
        self.target_lm_head = target_lm_head
        self.steps = steps

    def forward(self, batch):
        return ttt_forward(self.drafter, batch, self.target_lm_head, self.steps, LOSS_DECAY)


@dataclass
class Run:
    """What the loop needs, built once from the spec and the features."""

    layout: Layout
    train: list[Sample]
    val: list[Sample]
    drafter: Drafter
    target_lm_head: torch.Tensor
    vocab_coverage: float
    total_steps: int


def training_fields(spec) -> dict[str, Any]:
    return {k: v for k, v in spec.model_dump(mode="json").items() if k not in RESUME_MAY_CHANGE}


def drafter_config(target: str, draft_vocab_size: int) -> DrafterConfig:
    from transformers import AutoConfig

    return DrafterConfig.from_target(AutoConfig.from_pretrained(resolve_target(target)), draft_vocab_size)


def build_drafter(target: str, draft_vocab_size: int, embed: torch.Tensor, used: torch.Tensor) -> Drafter:
    """A fresh drafter: the target's frozen embedding, the draft vocabulary, PyTorch's default init elsewhere
    (seeded by the caller), as EAGLE and SpecForge start."""
    drafter = Drafter(drafter_config(target, draft_vocab_size))
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed)
        drafter.set_vocab(used)
    return drafter


def prepare(spec, layout: Layout, reader: FeatureReader) -> Run:
    train, val = split_samples(reader, spec.val_every)
    if not train:
        raise ValueError(f"features {spec.features}: no training samples (val_every={spec.val_every})")
    target = spec.target or layout.target
    embed, head = load_target_head(target)
    counts = token_counts(train, layout.vocab_size)
    used = select_vocab(counts, spec.draft_vocab_size)
    torch.manual_seed(spec.seed)
    drafter = build_drafter(target, spec.draft_vocab_size, embed, used)
    stream = BatchStream([s.input_ids.numel() for s in train], spec.batch_tokens, spec.seed)
    total = spec.steps or max(1, round(spec.epochs * stream.batches_per_epoch()))
    return Run(layout=layout, train=train, val=val, drafter=drafter, target_lm_head=head,
               vocab_coverage=coverage(counts, used), total_steps=total)


class TopCache:
    """Full-vocabulary target argmax per sample, computed once on first use (it costs a V-wide matmul)."""

    def __init__(self, samples: list[Sample], lm_head: torch.Tensor):
        self.samples, self.lm_head = samples, lm_head
        self.tops: dict[int, torch.Tensor] = {}

    def batch(self, indices: list[int], device):
        on = self.lm_head.device
        for i in indices:
            if i not in self.tops:
                s = self.samples[i]
                self.tops[i] = target_top(s.final_hidden.to(on), self.lm_head, label_rows(s.loss_mask).to(on)).cpu()
        return collate([self.samples[i] for i in indices], [self.tops[i] for i in indices]).to(device)


# ---------------------------------------------------------------- checkpoints


def _optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, torch.Tensor]:
    params = optimizer.param_groups[0]["params"]
    out: dict[str, torch.Tensor] = {}
    for name, p in zip(names, params, strict=True):
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = value.detach().cpu().contiguous()
    out["rng.torch"] = torch.get_rng_state()
    return out


def _load_optimizer(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor]) -> None:
    state = optimizer.state_dict()
    params = optimizer.param_groups[0]["params"]
    for idx, (name, p) in enumerate(zip(names, params, strict=True)):
        entry = {k: tensors[f"{name}.{k}"] for k in ADAMW_STATE if f"{name}.{k}" in tensors}
        if entry:
            state["state"][idx] = {k: (v if k == "step" else v.to(p.device)) for k, v in entry.items()}
    optimizer.load_state_dict(state)
    torch.set_rng_state(tensors["rng.torch"])


def save_checkpoint(output: Artifact, step: int, drafter: Drafter, optimizer, names: list[str],
                    position: DataPosition, history: dict, fields: dict[str, Any], info: dict[str, Any]) -> None:
    prefix = f"{CHECKPOINTS}/step-{step:08d}"
    weights = {k: v.detach().cpu().contiguous() for k, v in drafter.trainable_state_dict().items()}
    output.put_bytes(f"{prefix}/model.safetensors", save_safetensors(weights))
    output.put_bytes(f"{prefix}/optimizer.safetensors", save_safetensors(_optimizer_tensors(optimizer, names)))
    state = {"step": step, "data": {"epoch": position.epoch, "index": position.index}, "history": history,
             "spec": fields, "info": info}
    output.put_bytes(f"{prefix}/state.json", json.dumps(state).encode())
    previous = read_latest(output)
    output.put_bytes(LATEST, json.dumps({"step": step, "prefix": prefix}).encode())
    if previous and previous["prefix"] != prefix:
        output.store.delete_prefix(output.key(previous["prefix"]))


def read_latest(artifact: Artifact) -> dict | None:
    return json.loads(artifact.get_bytes(LATEST)) if artifact.exists(LATEST) else None


def load_checkpoint(artifact: Artifact) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(weights, optimizer tensors, state) of an artifact's latest checkpoint."""
    latest = read_latest(artifact)
    if latest is None:
        raise FileNotFoundError(f"{artifact.uri}: no {LATEST}")
    prefix = latest["prefix"]
    weights = load_safetensors(artifact.get_bytes(f"{prefix}/model.safetensors"))
    opt = load_safetensors(artifact.get_bytes(f"{prefix}/optimizer.safetensors"))
    return weights, opt, json.loads(artifact.get_bytes(f"{prefix}/state.json"))


def resume_source(spec, output: Artifact, settings: Settings) -> Artifact | None:
    """The artifact whose latest checkpoint this run continues from, if any."""
    if spec.resume == "never":
        return None
    if spec.resume == "auto":
        return output if read_latest(output) else None
    source = open_artifact(spec.resume, settings)
    if read_latest(source) is None:
        raise FileNotFoundError(f"resume={spec.resume!r}: no checkpoint there ({LATEST} is missing)")
    return source


# ---------------------------------------------------------------- the loop


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a CPU tensor over ranks (through the GPU when the backend is nccl)."""
    if not dist.is_initialized():
        return t
    x = t.cuda() if dist.get_backend() == "nccl" else t
    dist.all_reduce(x)
    return x.cpu()


def _autocast(spec, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.dtype == "bfloat16")


@torch.no_grad()
def validate(spec, run: Run, tops: TopCache, device) -> dict[str, Any]:
    rank, world = _rank_world()
    plan = eval_plan([s.input_ids.numel() for s in run.val], spec.batch_tokens)
    K = spec.ttt_steps
    stats = torch.zeros(2 + 3 * K, dtype=torch.float64)  # objective, denom, ce[K], correct[K], count[K]
    run.drafter.eval()
    for indices in plan[rank::world]:
        with _autocast(spec, device):
            r = ttt_forward(run.drafter, tops.batch(indices, device), run.target_lm_head, K, LOSS_DECAY)
        stats += torch.cat([r.objective.reshape(1), r.denom.reshape(1), r.ce_sum, r.correct, r.count]).double().cpu()
    run.drafter.train()
    stats = _all_sum(stats)
    denom, correct, count = stats[1].clamp(min=1), stats[2 + K: 2 + 2 * K], stats[2 + 2 * K:].clamp(min=1)
    return {"loss": float(stats[0] / denom), "acc": (correct / count).tolist()}


def train(spec, layout: Layout, reader: FeatureReader, output: Artifact, report: Report, settings: Settings) -> None:
    """Train (or continue training) to the spec's total steps, checkpointing into `output`; the last checkpoint
    (step == total) holds the result. Every rank of a torchrun job calls this."""
    rank, world = _rank_world()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    run = prepare(spec, layout, reader)
    drafter = run.drafter.to(device)
    head = run.target_lm_head.to(device)
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec.lr, betas=BETAS, weight_decay=WEIGHT_DECAY)
    fields = training_fields(spec)
    info = {"total_steps": run.total_steps, "train_samples": len(run.train), "val_samples": len(run.val),
            "vocab_coverage": run.vocab_coverage}

    step, position, history = 0, DataPosition(), {"train": [], "val": []}
    source = resume_source(spec, output, settings)
    if source is not None:
        weights, opt_tensors, state = load_checkpoint(source)
        if state["spec"] != fields:
            changed = sorted(k for k in set(fields) | set(state["spec"]) if fields.get(k) != state["spec"].get(k))
            raise ValueError(f"resume from {source.uri}: the checkpoint was trained with other settings ({changed})")
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        if unexpected or any(not k.startswith("embed_tokens.") for k in missing):
            raise ValueError(f"checkpoint {source.uri}: missing {missing}, unexpected {unexpected}")
        _load_optimizer(optimizer, names, opt_tensors)
        step, position, history = state["step"], DataPosition(**state["data"]), state["history"]
        log.info("resuming from %s at step %d", source.uri, step)

    tops_train, tops_val = TopCache(run.train, head), TopCache(run.val, head)
    if step == 0:  # where training starts from, for the record
        history["val"].append({"step": 0, **validate(spec, run, tops_val, device)})
    model = TTTObjective(drafter, head, spec.ttt_steps)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    stream = BatchStream([s.input_ids.numel() for s in run.train], spec.batch_tokens, spec.seed, position)
    total, K = run.total_steps, spec.ttt_steps
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=True if rank else None)
    while step < total:
        t0 = time.perf_counter()
        global_batch = stream.next()
        mine, real = shard(global_batch, rank, world)
        batch = tops_train.batch(mine, device)
        lr = lr_at(step, total, spec.warmup, spec.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with _autocast(spec, device):
            r = model(batch)
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
                 "tokens_per_s": float(stats[-1]) / elapsed}
        history["train"].append(entry)
        if spec.val_interval and step % spec.val_interval == 0 or step == total:
            history["val"].append({"step": step, **validate(spec, run, tops_val, device)})
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
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    """Entry point for torchrun (or a plain process): train a spec into an output artifact; rank 0 prints
    progress lines for the parent. The parent then exports the final checkpoint."""
    from services.trainer.core import Spec, open_features

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="trainer spec as JSON")
    p.add_argument("--output", required=True, help="output artifact URI (checkpoints go under it)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    spec = Spec.model_validate_json(args.spec)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        settings = get_settings()  # this process (a torchrun rank) reads the worker's environment
        reader, layout = open_features(spec, settings)

        def report(step: int, total: int, metrics: dict[str, Any]) -> None:
            print(PROGRESS_TAG + json.dumps({"step": step, "total": total, "metrics": metrics}), flush=True)

        train(spec, layout, reader, open_artifact(args.output, settings), report, settings)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])

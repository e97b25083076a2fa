"""Training checkpoints: weights, optimizer state, RNG, data position and history, exactly resumable.

Checkpoints live under the job's output prefix (rank 0 writes them; no pickle anywhere):
  checkpoints/step-NNNNNNNN/model.safetensors      drafter weights without the frozen embedding, plus d2t/t2d
  checkpoints/step-NNNNNNNN/optimizer.safetensors  AdamW exp_avg / exp_avg_sq / step per parameter, RNG state
  checkpoints/step-NNNNNNNN/state.json             step, data position, history, the spec fields that shape training
  checkpoints/latest.json                          written last: the commit marker of a checkpoint
  checkpoints/validation.safetensors               the validation samples, where the features are deleted as
                                                   training consumes them (a recompute hand-off, eyas.handoff)
Resume loads all of it and continues with exactly the losses an uninterrupted run would have had. The final
checkpoint (step == total steps) is what the stage exports.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from eyas.features import Sample, ShardBuffer, shard_samples
from eyas.settings import Settings
from eyas.store import Artifact, open_artifact
from services.trainer.data import DataPosition
from services.trainer.spec import Spec

ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")
CHECKPOINTS = "checkpoints"
LATEST = f"{CHECKPOINTS}/latest.json"
VALIDATION = f"{CHECKPOINTS}/validation.safetensors"


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


def save_checkpoint(output: Artifact, step: int, drafter: Any, optimizer, names: list[str],
                    position: DataPosition, history: dict, fields: dict[str, Any], info: dict[str, Any]) -> None:
    prefix = f"{CHECKPOINTS}/step-{step:08d}"
    # cloned: a DFlash drafter's tied k_norm is one tensor under several names, which safetensors refuses
    weights = {k: v.detach().cpu().clone().contiguous() for k, v in drafter.trainable_state_dict().items()}
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


def resume_source(spec: Spec, output: Artifact, settings: Settings) -> Artifact | None:
    """The artifact whose latest checkpoint this run continues from, if any."""
    if spec.resume == "never":
        return None
    if spec.resume == "auto":
        return output if read_latest(output) else None
    source = open_artifact(spec.resume, settings)
    if read_latest(source) is None:
        raise FileNotFoundError(f"resume={spec.resume!r}: no checkpoint there ({LATEST} is missing)")
    return source


def restore(source: Artifact, drafter: Any, optimizer: torch.optim.Optimizer, names: list[str],
            fields: dict[str, Any]) -> tuple[int, DataPosition, dict]:
    """Load `source`'s latest checkpoint into the drafter and optimizer; returns (step, data position, history).
    Refuses a checkpoint trained with other settings (`fields`: the spec fields that shape training)."""
    weights, opt_tensors, state = load_checkpoint(source)
    if state["spec"] != fields:
        changed = sorted(k for k in set(fields) | set(state["spec"]) if fields.get(k) != state["spec"].get(k))
        raise ValueError(f"resume from {source.uri}: the checkpoint was trained with other settings ({changed})")
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if unexpected or set(missing) & set(drafter.trainable_state_dict()):  # the target's tensors are not saved
        raise ValueError(f"checkpoint {source.uri}: missing {missing}, unexpected {unexpected}")
    _load_optimizer(optimizer, names, opt_tensors)
    return state["step"], DataPosition(**state["data"]), state["history"]


def save_validation(output: Artifact, val: list[Sample]) -> None:
    """Keep the validation samples beside the checkpoints: a resumed run cannot read them from deleted shards."""
    if val and not output.exists(VALIDATION):
        buf = ShardBuffer()
        for sample in val:
            buf.add(sample)
        with tempfile.TemporaryDirectory(prefix="eyas-val-") as tmp:
            buf.write(Path(tmp) / "v.safetensors")
            output.put_file(VALIDATION, Path(tmp) / "v.safetensors")


def load_validation(source: Artifact) -> list[Sample] | None:
    """The validation samples a run kept (save_validation), None where it kept none."""
    if not source.exists(VALIDATION):
        return None
    return [Sample(*(t.clone() for t in (s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden)))
            for s in shard_samples(load_safetensors(source.get_bytes(VALIDATION)))]

"""Trainer stage: features → EAGLE-3 drafter (TTT training) → exports vLLM, SGLang and speculators load.

The drafter artifact (drafters/{job_id}/):
  manifest.json   kind "drafter", layout = the features' layout, inputs = [features URI],
                  extra = {ttt_steps, draft_vocab_size, val_every, target, metrics}
  eagle/          config.json + model.safetensors, EAGLE/SpecForge layout (services.trainer.export)
  speculators/    config.json + model.safetensors, speculators format
  history.json    {"train": [{step, loss, acc[k], lr, tokens_per_s}], "val": [{step, loss, acc[k]}]}
Training runs in this process, or under torchrun when `processes` > 1 (DDP; the parent relays progress and
cancellation). Checkpoints under checkpoints/ let a redelivered or resumed job continue exactly where it
stopped; they are removed once the artifact is committed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from eyas.features import FeatureReader
from eyas.layout import Layout, check_layout
from eyas.manifest import ArtifactWriter, Manifest
from eyas.settings import Settings
from eyas.stages import StageContext, StageResult, StageSpec
from eyas.store import open_artifact
from eyas.target import config_hash, load_tokenizer, resolve_target, tokenizer_hash
from services.trainer.export import export_drafter
from services.trainer.train import CHECKPOINTS, PROGRESS_TAG, drafter_config, load_checkpoint, train
from services.trainer.vocab import DEFAULT_DRAFT_VOCAB

log = logging.getLogger(__name__)
INPUT_FIELD = "features"

# Settings for a CPU run on the bundled target, about 2 minutes for 27k feature tokens on 2 cores (~650 training
# tokens/s quiet). On 58.6k tokens (1 epoch, K = 3), 512-token batches beat 1024 and 2048 at equal compute (more
# optimizer steps), lr 3e-3 beat 1e-3, and Vd = 4096 covered 97.8 % of supervised tokens. On the 27k tokens of
# `eyas run`'s 96 synthesized conversations, 3 epochs lifted validation accuracy per TTT step from
# 0.24/0.15/0.10 (1 epoch) to 0.37/0.28/0.23. Initializing the draft lm_head from the target's rows did not help
# (0.22/0.13/0.05 at 1 epoch). `eyas run` merges these into its trainer spec.
CPU_PRESET: dict[str, Any] = {"ttt_steps": 3, "draft_vocab_size": 4096, "lr": 3e-3, "batch_tokens": 512,
                              "warmup": 10, "epochs": 3.0}


class Spec(StageSpec):
    features: str = Field(description="features artifact URI (s3://bucket/features/ID) or local directory")
    target: str | None = Field(None, description="target model (HF directory or the bundled name); "
                                                 "default: the one the features record")
    draft_vocab_size: int = Field(DEFAULT_DRAFT_VOCAB, ge=16, description="Vd, the drafter's vocabulary size")
    ttt_steps: int = Field(7, ge=1, le=16, description="training-time-test steps (drafted tokens trained)")
    steps: int | None = Field(None, ge=1, description="optimizer steps; default: `epochs` over the train split")
    epochs: float = Field(1.0, gt=0, le=1000)
    lr: float = Field(1e-4, gt=0, le=1, description="peak learning rate (AdamW)")
    warmup: int = Field(50, ge=0, description="linear warmup steps, then cosine decay to 0")
    batch_tokens: int = Field(4096, ge=16, description="padded tokens per optimizer step (all processes)")
    val_every: int = Field(10, ge=2, description="sample i is validation iff i % val_every == 0")
    val_interval: int = Field(100, ge=0, description="validate every N steps (0: only at the end)")
    checkpoint_every: int = Field(200, ge=1, description="checkpoint every N steps (and at the end)")
    seed: int = Field(0, ge=0)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (bf16: autocast)")
    resume: str = Field("auto", min_length=1, description="'auto' (continue this job's own checkpoint if any), "
                        "'never', or the URI of an unfinished trainer job's artifact to continue")
    processes: int = Field(1, ge=1, le=64, description=">1: DDP under torchrun with this many processes")


def open_features(spec: Spec, settings: Settings) -> tuple[FeatureReader, Layout]:
    """The features reader and its layout, after checking that the target here is the one they were extracted
    from (config and tokenizer/chat-template hashes, sizes)."""
    reader = FeatureReader(open_artifact(spec.features, settings))
    layout = reader.layout
    target = spec.target or layout.target
    cfg = json.loads((resolve_target(target) / "config.json").read_text())
    here = Layout(target=target, target_config_hash=config_hash(resolve_target(target)),
                  tokenizer_hash=tokenizer_hash(load_tokenizer(target)), num_layers=cfg["num_hidden_layers"],
                  hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"], aux_layers=layout.aux_layers,
                  dtype=layout.dtype)
    check_layout(here, layout, what=f"features {spec.features} for target {target!r}")
    return reader, layout


def _train_distributed(spec: Spec, ctx: StageContext) -> None:
    """torchrun with `processes` ranks; rank 0's progress lines become this job's progress. A cancel (raised by
    ctx.progress) stops the whole process group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={spec.processes}",
           "-m", "services.trainer.train", "--spec", spec.model_dump_json(), "--output", ctx.output.uri]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS_TAG):
                msg = json.loads(line[len(PROGRESS_TAG):])
                ctx.metrics.update(msg["metrics"])
                ctx.progress(msg["step"], msg["total"], "steps")
            else:
                sys.stdout.write(line)
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"torchrun with {spec.processes} processes exited with {rc}")


def _summary(history: dict, info: dict) -> dict[str, Any]:
    train_h, val_h = history["train"], history["val"]
    timed = train_h[1:] or train_h  # the first step also pays for one-time work (target top-1 caching)
    metrics: dict[str, Any] = {
        "steps": len(train_h), "train_loss": train_h[-1]["loss"], "train_acc": train_h[-1]["acc"],
        "tokens_per_s": sum(e["tokens_per_s"] for e in timed) / len(timed),
        "train_samples": info["train_samples"], "val_samples": info["val_samples"],
        "vocab_coverage": info["vocab_coverage"],
    }
    if val_h:
        metrics.update(val_loss=val_h[-1]["loss"], val_acc=val_h[-1]["acc"])
    return metrics


def run(spec: Spec, ctx: StageContext) -> StageResult:
    reader, layout = open_features(spec, ctx.settings)
    if spec.processes > 1:
        _train_distributed(spec, ctx)
    else:
        def report(step: int, total: int, metrics: dict[str, Any]) -> None:
            ctx.metrics.update(metrics)
            ctx.progress(step, total, "steps")

        train(spec, layout, reader, ctx.output, report, ctx.settings)
    weights, _, state = load_checkpoint(ctx.output)
    target = spec.target or layout.target
    metrics = _summary(state["history"], state["info"])
    target_cfg = json.loads((resolve_target(target) / "config.json").read_text())
    verifier = {"name_or_path": str(resolve_target(target)), "architectures": target_cfg.get("architectures", [])}

    writer = ArtifactWriter(ctx.output)
    with tempfile.TemporaryDirectory(prefix="eyas-drafter-") as tmp:
        cfg = drafter_config(target, spec.draft_vocab_size)
        for rel in export_drafter(cfg, weights, layout, Path(tmp), spec.dtype, verifier, spec.ttt_steps):
            writer.put_file(rel.as_posix(), Path(tmp) / rel)
    writer.put_bytes("history.json", json.dumps(state["history"], indent=1).encode())
    manifest = writer.commit(Manifest(
        kind="drafter", id=ctx.job_id, job_spec=spec.model_dump(mode="json"), inputs=[spec.features],
        counts={"train_samples": state["info"]["train_samples"], "val_samples": state["info"]["val_samples"],
                "steps": state["step"]},
        layout=layout.to_dict(),
        extra={"ttt_steps": spec.ttt_steps, "draft_vocab_size": spec.draft_vocab_size, "val_every": spec.val_every,
               "target": target, "metrics": metrics},
    ))
    ctx.output.store.delete_prefix(ctx.output.key(CHECKPOINTS))
    log.info("drafter: %d steps, val acc %s → %s", state["step"], metrics.get("val_acc"), ctx.output.uri)
    exports = sorted({n.split("/")[0] for n in manifest.files if n.endswith("/config.json")})  # eagle, speculators
    return StageResult(output_uri=ctx.output.uri, metrics=manifest.extra["metrics"],
                       artifacts={name: f"{ctx.output.uri}/{name}" for name in exports})

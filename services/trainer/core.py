"""Trainer stage: features → drafter (EAGLE-3 or P-EAGLE by TTT training, or DFlash) → exports the engines load.

The drafter artifact (drafters/{job_id}/):
  manifest.json   kind "drafter", layout = the features' layout, inputs = [features URI], metrics, and
                  drafter = {target, ttt_steps, val_every, draft_vocab_size, unsupported_engines}
  eagle/          config.json + model.safetensors, EAGLE/SpecForge layout (eyas.exports)
  speculators/    config.json + model.safetensors, speculators format
  dflash/         instead of both for method "dflash": vLLM's DFlashDraftModel (eyas.dflash)
  history.json    {"train": [{step, loss, acc[k], lr, tokens_per_s}], "val": [{step, loss, acc[k]}]}
Training runs in this process, or under torchrun when `processes` > 1 (DDP over the node's GPUs, by default all
of them; the parent relays progress and cancellation). Across nodes, torchrun's rendezvous runs the same training
module on every node (docs/operations.md, "On GPUs"); a train job whose `resume` names that run's artifact then exports
it.
Checkpoints under checkpoints/ let a redelivered or resumed job continue exactly where it stopped; they are
removed once the artifact is committed.
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from eyas.exports import HISTORY, speculators_verifier
from eyas.handoff import FINISHED, abort
from eyas.manifest import ArtifactWriter, DrafterFacts, Manifest
from eyas.methods import get_method
from eyas.ranks import run_ranks
from eyas.stage import StageContext, StageResult
from eyas.target import load_target_head, resolve_target
from services.trainer.checkpoint import CHECKPOINTS, load_checkpoint
from services.trainer.inputs import open_features, resolve
from services.trainer.spec import Spec
from services.trainer.train import PROGRESS_TAG, train

log = logging.getLogger(__name__)
INPUT_FIELD = "features"

def _train_distributed(spec: Spec, ctx: StageContext) -> None:
    """torchrun with `processes` ranks; rank 0's progress lines become this job's progress. A cancel (raised by
    ctx.check, between lines and while none comes) stops the whole process group."""

    def relay(line: str) -> bool:
        if not line.startswith(PROGRESS_TAG):
            return False
        msg = json.loads(line[len(PROGRESS_TAG):])
        ctx.metrics.update(msg["metrics"])
        ctx.progress(msg["step"], msg["total"], "steps")
        return True

    run_ranks("services.trainer.train", spec.processes, ["--spec", spec.model_dump_json(), "--output",
                                                         ctx.output.uri], relay, "processes", check=ctx.check)


def _summary(history: dict, info: dict) -> dict[str, Any]:
    train_h, val_h = history["train"], history["val"]
    timed = train_h[1:] or train_h  # the first step also pays for one-time work (target top-1 caching)
    metrics: dict[str, Any] = {
        "steps": len(train_h), "train_loss": train_h[-1]["loss"], "train_acc": train_h[-1]["acc"],
        "tokens_per_s": sum(e["tokens_per_s"] for e in timed) / len(timed),
        "train_samples": info["train_samples"], "val_samples": info["val_samples"],
        "vocab_coverage": info["vocab_coverage"],
        "feature_windows": info.get("feature_windows", 1),  # windows of shards an epoch read through the cache
    }
    if val_h:
        metrics.update(val_loss=val_h[-1]["loss"], val_acc=val_h[-1]["acc"])
    return metrics


def run(spec: Spec, ctx: StageContext) -> StageResult:
    spec = resolve(spec, ctx.settings)  # once: torchrun's ranks, the exports and the manifest see the same values
    reader, layout = open_features(spec, ctx.settings, ctx.stop)
    try:
        if spec.processes > 1:
            _train_distributed(spec, ctx)
        else:
            def report(step: int, total: int, metrics: dict[str, Any]) -> None:
                ctx.metrics.update(metrics)
                ctx.progress(step, total, "steps")

            train(spec, layout, reader, ctx.output, report, ctx.settings)
    except BaseException as e:
        if reader.stream is not None:  # an extractor feeding this job stops waiting for it
            abort(reader.artifact, "trainer", f"{type(e).__name__}: {e}")
        raise
    if reader.stream is not None:
        reader.artifact.put_bytes(FINISHED, b"{}")
    weights, _, state = load_checkpoint(ctx.output)
    target = spec.target or layout.target
    metrics = _summary(state["history"], state["info"])
    target_cfg = json.loads((resolve_target(target) / "config.json").read_text())
    verifier = speculators_verifier(target, target_cfg, spec.verifier)
    weights["embed_tokens.weight"], head = load_target_head(target)  # the speculators export carries it

    writer = ArtifactWriter(ctx.output)
    with tempfile.TemporaryDirectory(prefix="eyas-drafter-") as tmp:
        written, unsupported = get_method(spec.method).export(spec, target, layout, weights, head, Path(tmp),
                                                             verifier)
        for rel in written:
            writer.put_file(rel.as_posix(), Path(tmp) / rel)
    for engine, why in unsupported.items():
        log.warning("%s cannot serve this drafter: %s", engine, why)
    writer.put_bytes(HISTORY, json.dumps(state["history"], indent=1).encode())
    manifest = writer.commit(Manifest(
        kind="drafter", id=ctx.job_id, job_spec=spec.model_dump(mode="json"), inputs=[spec.features],
        counts={"train_samples": state["info"]["train_samples"], "val_samples": state["info"]["val_samples"],
                "steps": state["step"]},
        layout=layout.to_dict(), metrics=metrics,
        extra={"compute": {"device": state["info"]["device"], "processes": state["info"]["processes"],
                           "dtype": spec.dtype}},
        drafter=DrafterFacts(target=target, ttt_steps=spec.ttt_steps, val_every=spec.val_every,
                             draft_vocab_size=spec.draft_vocab_size, method=spec.method,
                             unsupported_engines=unsupported,
                             chat_template_kwargs=reader.chat_template_kwargs),
    ))
    ctx.output.store.delete_prefix(ctx.output.key(CHECKPOINTS))
    log.info("drafter: %d steps, val acc %s → %s", state["step"], metrics.get("val_acc"), ctx.output.uri)
    exports = sorted({n.split("/")[0] for n in manifest.files if n.endswith("/config.json")})  # eagle, speculators
    return StageResult(output_uri=ctx.output.uri, metrics=manifest.metrics,
                       artifacts={name: f"{ctx.output.uri}/{name}" for name in exports})

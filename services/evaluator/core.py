"""Evaluator stage: drafter (+ target, + optional live vLLM endpoints) → report.

  1. wiring     the drafter's exports, as vLLM and SGLang load them, feed it the tensors it was trained on (else the
                job fails naming the export, the engine, both layer lists and the kind of mismatch)
  2. accuracy   teacher-forced accuracy per TTT step (services.trainer.ttt.ttt_forward) on the validation split of
                the drafter's own features (or on all samples of `features` when given)
  3. acceptance greedy chain speculative decoding with the real target on (held-out MT-bench) prompts: τ and
                per-position acceptance in vLLM's definitions, and equality with the target's plain greedy output
  4. live       with `endpoint` / `spec_endpoint`: the same prompts on vLLM without / with the drafter
Writes reports/{id}/: report.json, report.html, PNGs, manifest (kind "report").
"""
from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, field_validator

from eyas.drafter import Drafter, load_drafter
from eyas.features import FeatureReader, is_validation
from eyas.layout import Layout
from eyas.manifest import ArtifactWriter, Manifest, fetch_verified, read_manifest
from eyas.settings import Settings
from eyas.stages import StageContext, StageResult, StageSpec
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target
from services.evaluator import report as reports
from services.evaluator.heldout import check_held_out
from services.evaluator.live import live_ab
from services.evaluator.specdec import eval_prompts, evaluate
from services.evaluator.wiring import check_wiring
from services.generator.core import resolve_prompt_file
from services.generator.dataset import load_prompts
from services.trainer.data import collate, eval_plan
from services.trainer.ttt import ttt_forward

log = logging.getLogger(__name__)
INPUT_FIELD = "drafter"
EXPORTS = ("eagle", "speculators")


class Spec(StageSpec):
    drafter: str = Field(description="drafter artifact URI (s3://bucket/drafters/ID) or local directory")
    target: str = Field(BUNDLED, description="target model: HF directory or the bundled name")
    k: int = Field(3, ge=1, le=16, description="draft tokens per target forward (chain)")
    prompts: str = Field("bundled:mt_bench", description="prompts to decode (first user turns): a prompt file or "
                                                       "bundled:NAME; MT-bench is held out from training")
    num_prompts: int = Field(20, ge=1, le=10_000, description="the first N prompts")
    max_new_tokens: int = Field(128, ge=1, le=4096)
    features: str | None = Field(None, description="features URI for accuracy (all samples); default: the "
                                                   "drafter's own features, validation split")
    batch_tokens: int = Field(8192, ge=256, description="padded tokens per accuracy batch")
    engines: list[Literal["vllm", "sglang"]] = Field(["vllm", "sglang"], description="engines the wiring must fit")
    endpoint: str | None = Field(None, description="vLLM serving the target without the drafter (live A/B)")
    spec_endpoint: str | None = Field(None, description="vLLM serving the target with this drafter (live A/B)")
    concurrency: int = Field(1, ge=1, le=256, description="concurrent requests in the live A/B")

    @field_validator("prompts")
    @classmethod
    def _prompts_readable(_cls, v: str) -> str:
        load_prompts(resolve_prompt_file(v), limit=1)  # raises PromptFileError naming the file and record
        return v


@torch.no_grad()
def teacher_forced_accuracy(drafter: Drafter, lm_head: torch.Tensor, reader: FeatureReader, val_every: int | None,
                            steps: int, batch_tokens: int) -> tuple[list[float], int]:
    """Per-TTT-step accuracy over the samples (validation split when val_every is set); returns (acc, samples)."""
    samples = [s for i, s in enumerate(reader.samples()) if val_every is None or is_validation(i, val_every)]
    if not samples:
        return [], 0
    correct = torch.zeros(steps)
    count = torch.zeros(steps)
    for idx in eval_plan([s.input_ids.numel() for s in samples], batch_tokens):
        res = ttt_forward(drafter, collate([samples[i] for i in idx]), lm_head, steps)
        correct += res.correct.cpu()
        count += res.count.cpu()
    return (correct / count.clamp(min=1)).tolist(), len(samples)


def _fetch_drafter(uri: str, dest: Path, settings: Settings) -> Manifest:
    art = open_artifact(uri, settings)
    manifest = read_manifest(art, kind="drafter")
    for name in manifest.files:
        if name.split("/", 1)[0] in EXPORTS or name == "history.json":
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            fetch_verified(art, manifest, name, dest / name)
    if not (dest / "eagle" / "config.json").is_file():
        raise ValueError(f"drafter {uri} has no eagle/ export (config.json + model.safetensors)")
    return manifest


def run(spec: Spec, ctx: StageContext) -> StageResult:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="eyas-eval-") as tmp:
        local = Path(tmp)
        manifest = _fetch_drafter(spec.drafter, local, ctx.settings)
        if not manifest.layout:
            raise ValueError(f"drafter {spec.drafter}: manifest carries no layout")
        layout = Layout.from_dict(manifest.layout)
        target = load_target(spec.target, dtype=torch.float32)
        wiring = check_wiring(layout, local, target, tuple(spec.engines))
        drafter, _ = load_drafter(local / "eagle", target.model.get_input_embeddings().weight.detach())
        history = json.loads((local / "history.json").read_text()) if (local / "history.json").is_file() else None

        trained_on = manifest.inputs[0] if manifest.inputs else None  # the drafter's training features
        checked = check_held_out(spec.prompts, spec.num_prompts, trained_on, ctx.settings)
        ctx.metrics.update(held_out_prompts_checked=checked)
        features_uri = spec.features or trained_on
        steps = max(spec.k, int(manifest.extra.get("ttt_steps", spec.k)))
        accuracy, acc_samples = [], 0
        if features_uri:
            reader = FeatureReader(open_artifact(features_uri, ctx.settings), expected=layout)
            val_every = None if spec.features else int(manifest.extra.get("val_every", 10))
            accuracy, acc_samples = teacher_forced_accuracy(
                drafter, target.model.get_output_embeddings().weight.detach(), reader, val_every, steps,
                spec.batch_tokens)
        ctx.metrics.update(per_position_accuracy=accuracy)

        prompts = eval_prompts(target.tokenizer, spec.prompts, spec.num_prompts)
        decoded = evaluate(target, drafter, layout.aux_layers, prompts, spec.k, spec.max_new_tokens,
                           progress=lambda done, total: ctx.progress(done, total, "prompts"))
        if not decoded["matches_greedy"]:
            log.warning("speculative output differs from plain greedy for %s", decoded["greedy_mismatches"])
        live = None
        if spec.endpoint or spec.spec_endpoint:
            live = live_ab(prompts, spec.max_new_tokens, spec.endpoint, spec.spec_endpoint, spec.concurrency)
            greedy_out = [r["output"] for r in decoded["per_prompt"]]
            for run_ in ("baseline", "speculative"):
                if run_ in live:  # token ids are compared here, not stored
                    live[run_]["matches_in_process_greedy"] = live[run_].pop("outputs") == greedy_out

    drafter_uri = open_artifact(spec.drafter, ctx.settings).uri
    report = {
        "target": spec.target,
        "layout": layout.to_dict(),
        "k": spec.k,
        "per_position_accuracy": accuracy,
        "acceptance_length": decoded["acceptance_length"],
        "per_position_acceptance": decoded["per_position_acceptance"],
        "exports": {name: f"{drafter_uri}/{name}" for name in EXPORTS if f"{name}/config.json" in manifest.files},
        "expected_acceptance_length": reports.expected_acceptance_length(accuracy, spec.k) if accuracy else None,
        "drafter": drafter_uri,
        "features": {"uri": features_uri, "split": "all" if spec.features else "validation",
                     "samples": acc_samples, "ttt_steps": steps},
        "prompts": {"source": spec.prompts, "count": len(prompts), "turn": "first user turn"},
        "wiring": wiring,
        "in_process": {key: v for key, v in decoded.items() if key != "per_prompt"},
        "per_prompt": decoded["per_prompt"],
        "training": manifest.extra.get("metrics", {}),
    }
    if live is not None:
        report["live"] = live
    files = reports.build(report, history)
    writer = ArtifactWriter(ctx.output)
    for name, data in files.items():
        writer.put_bytes(name, data)
    metrics = {"acceptance_length": decoded["acceptance_length"], "k": spec.k,
               "per_position_acceptance": decoded["per_position_acceptance"], "per_position_accuracy": accuracy,
               "matches_greedy": decoded["matches_greedy"]}
    if live is not None:
        metrics.update({f"live_{k}": v for k, v in (live.get("speculative") or {}).items()
                        if k in ("acceptance_length", "per_position_acceptance", "tok_s")})
        if "speedup" in live:
            metrics["live_speedup"] = live["speedup"]
    writer.commit(Manifest(kind="report", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
                           inputs=[drafter_uri] + ([features_uri] if features_uri else []),
                           counts={"prompts": len(prompts), "drafts": decoded["drafts"],
                                   "accepted": decoded["accepted"], "accuracy_samples": acc_samples},
                           layout=layout.to_dict(), extra={"metrics": metrics}))
    out = ctx.output.uri
    return StageResult(output_uri=out, metrics=metrics,
                       artifacts={"report_json": f"{out}/report.json", "report_html": f"{out}/report.html"})

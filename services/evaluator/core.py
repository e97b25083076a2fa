"""Evaluator stage: drafter (+ target, + optional live vLLM endpoints) → report.

  1. wiring     the drafter's exports, as vLLM and SGLang load them, feed it the tensors it was trained on (else the
                job fails naming the export, the engine, both layer lists and the kind of mismatch)
  2. accuracy   teacher-forced accuracy per TTT step (eyas.ttt.ttt_forward) on the validation split of
                the drafter's own features (or on all samples of `features` when given)
  3. acceptance the real target's plain greedy output on (held-out MT-bench) prompts (batched), then one
                teacher-forced pass per prompt replayed as K-chains (services.evaluator.chains): τ and per-position
                acceptance in vLLM's definitions for every K ≤ 7, at the cost of a forward per prompt instead of
                one per round; against what teacher-forced accuracy predicts per position; and τ on a second
                held-out set (ShareGPT first turns), so a gain that fits one benchmark only shows
  4. decoding   real greedy chain speculative decoding in-process on the first `decode_prompts` prompts: its
                output must equal the plain greedy output, and its counts the replay's (`in_process`)
  5. live       with `endpoint` / `spec_endpoint`: the same prompts on vLLM without / with the drafter
  6. serving    predicted tokens/s and speed-up per (concurrency, K) from step times measured on the serving engine,
                the best K and where speculation stops paying (services.evaluator.serving); checked live on vLLM
                at two concurrencies when both endpoints are given or Settings.vllm_command starts the missing ones
Writes reports/{id}/: report.json, report.html, PNGs, manifest (kind "report").
"""
from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

import torch
from pydantic import Field

from eyas.batching import collate, eval_plan
from eyas.confine import names
from eyas.device import DTypeName, placement
from eyas.drafter import Drafter
from eyas.exports import EAGLE_DIR, EXPORT_DIRS, HISTORY, load_drafter
from eyas.features import FeatureReader, is_validation
from eyas.layout import Layout
from eyas.manifest import ArtifactWriter, Manifest, fetch_verified, read_manifest
from eyas.prompts import BUNDLED_NAMES
from eyas.settings import Settings
from eyas.stage import StageContext, StageResult, StageSpec
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target, resolve_target
from eyas.ttt import ttt_forward
from services.evaluator import costmodel, launch, serving
from services.evaluator import report as reports
from services.evaluator.heldout import TrainedOnEvalPrompts, check_held_out
from services.evaluator.live import live_ab
from services.evaluator.chains import chain_acceptance, replay, run_lengths
from services.evaluator.specdec import PromptIds, eval_prompts, greedy, measure_acceptance, stop_ids
from services.evaluator.wiring import check_wiring

log = logging.getLogger(__name__)
INPUT_FIELD = "drafter"


class Spec(StageSpec):
    drafter: names("artifact") = Field(description="drafter artifact URI (s3://bucket/drafters/ID) or local directory")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="target model: HF directory (under an input root) or the bundled name")
    k: int = Field(3, ge=1, le=16, description="draft tokens per target forward (chain)")
    prompts: names("prompts", s3=False, exact=BUNDLED_NAMES) = Field(
        "bundled:mt_bench", description="prompts to decode (first user turns): a prompt file or bundled:NAME; "
        "MT-bench is held out from training")
    num_prompts: int = Field(20, ge=1, le=10_000, description="N prompts spread evenly over the file, one per "
                             "distinct first turn (MT-bench's 8 categories in equal shares, where the first 20 "
                             "would be writing and role play only)")
    second_prompts: names("prompts", s3=False, exact=BUNDLED_NAMES) | None = Field(
        "bundled:sharegpt", description="a second held-out prompt set scored beside `prompts` (first user turns), "
        "so that a gain that fits only one benchmark shows; skipped, with the reason in the report, when the "
        "drafter was trained on it; null: none")
    second_num_prompts: int = Field(5, ge=1, le=10_000, description="N prompts of second_prompts, "
                                    "spread evenly, distinct first turns")
    max_new_tokens: int = Field(128, ge=1, le=4096)
    decode_prompts: int | None = Field(
        None, ge=1, le=10_000, description="prompts also decoded speculatively in-process, token by token (the "
        "check that the replayed τ is what real decoding counts); τ itself comes from every prompt's replay; "
        "default: all")
    features: names("artifact") | None = Field(
        None, description="features URI for accuracy (all samples); default: the drafter's own features, "
        "validation split")
    batch_tokens: int = Field(8192, ge=256, le=16_777_216, description="padded tokens per accuracy batch")
    engines: list[Literal["vllm", "sglang"]] = Field(["vllm", "sglang"], max_length=2,
                                                     description="engines the wiring must fit")
    endpoint: names("endpoint") | None = Field(
        None, description="vLLM serving the target without the drafter (live A/B; EYAS_ALLOWED_ENDPOINTS)")
    spec_endpoint: names("endpoint") | None = Field(
        None, description="vLLM serving the target with this drafter (live A/B; EYAS_ALLOWED_ENDPOINTS)")
    concurrency: int = Field(1, ge=1, le=256, description="concurrent requests in the live A/B")
    dtype: DTypeName = Field("auto", description="target and drafter dtype; auto: EYAS_DTYPE (bf16 on a GPU, fp32 "
                             "on the CPU)")


def _second_set(spec: Spec, settings, target, drafter: Drafter, layout: Layout, trained_on: str | None,
                chat_template_kwargs: dict | None) -> dict | None:
    """τ on the second held-out prompt set (a default the user did not pick, so a trained-on set is skipped with
    the reason, not an error)."""
    if spec.second_prompts is None:
        return None
    try:
        check_held_out(spec.second_prompts, spec.second_num_prompts, trained_on, settings)
    except TrainedOnEvalPrompts as e:
        return {"source": spec.second_prompts, "skipped": str(e)}
    prompts = eval_prompts(target.tokenizer, spec.second_prompts, spec.second_num_prompts, chat_template_kwargs)
    _, _, per_k = _replayed(target, drafter, layout, prompts, spec.max_new_tokens, spec.k)
    scored = per_k[spec.k]
    return {"source": spec.second_prompts, "count": len(prompts), "acceptance_length": scored["acceptance_length"],
            "per_position_acceptance": scored["per_position_acceptance"]}


def _replayed(target, drafter: Drafter, layout: Layout, prompts: list[PromptIds], max_new_tokens: int,
              k: int) -> tuple[list[list[int]], list[list[int]], dict[int, dict]]:
    """The target's plain greedy outputs, per prompt the run lengths of K_max-chains over them (one teacher-forced
    pass each; services.evaluator.chains), and their replay for every K ≤ K_max (K_max covers `k`)."""
    outputs = greedy(target, [p.ids for p in prompts], max_new_tokens, stop_ids(target))
    k_max = max(serving.K_MAX, k)
    runs = [run_lengths(target, drafter, layout.aux_layers, p.ids, out, k_max)
            for p, out in zip(prompts, outputs, strict=True)]
    return outputs, runs, replay(runs, k_max)


def _per_prompt(prompts: list[PromptIds], outputs: list[list[int]], runs: list[list[int]], k: int) -> list[dict]:
    """Each prompt's own replayed drafts and accepted per position (τ's spread over prompts)."""
    rows = []
    for p, out, run in zip(prompts, outputs, runs, strict=True):
        c = chain_acceptance([run], k)
        rows.append({"id": p.id, "category": p.category, "tokens": len(out), "drafts": c["drafts"],
                     "accepted_per_pos": c["accepted_per_pos"]})
    return rows


def _per_category(prompts: list[PromptIds], runs: list[list[int]], k: int) -> dict[str, float | None]:
    """τ over each category's prompts (MT-bench's writing, math, coding, …), where the prompt file has them."""
    groups: dict[str, list[list[int]]] = {}
    for p, run in zip(prompts, runs, strict=True):
        if p.category:
            groups.setdefault(p.category, []).append(run)
    return {cat: chain_acceptance(rs, k)["acceptance_length"] for cat, rs in groups.items()}


def _gap(accuracy: list[float], measured: list[float | None], k: int) -> dict | None:
    """Measured per-position acceptance against what teacher-forced accuracy predicts: where drafts collapse."""
    if not accuracy:
        return None
    expected = reports.expected_per_position(accuracy, k)
    return {"expected": expected, "measured": measured,
            "ratio": [round(m / e, 3) if m is not None and e else None for m, e in zip(measured, expected, strict=True)]}


def _serving(spec: Spec, ctx: StageContext, target, drafter: Drafter, prompts, per_k: dict[int, dict],
             eagle_dir: Path, eagle_model: str) -> dict:
    """Predict serving speed per (concurrency, K) and check it live when vLLM is at hand: the job's endpoints, or
    servers started with the operator's Settings.vllm_command (the speculative one at the recommended K)."""
    key = ctx.settings.endpoint_api_key
    api_key = key.get_secret_value() if key else None
    command = ctx.settings.vllm_command
    with contextlib.ExitStack() as servers:
        endpoint = spec.endpoint or (servers.enter_context(launch.vllm(command, resolve_target(spec.target)))
                                     if command else None)
        times, measured = serving.measure_steps(target, drafter, prompts[0].ids, endpoint, api_key)
        out = {**measured, **serving.predict(times, per_k, eagle_model)}
        spec_endpoint = spec.spec_endpoint
        if command and not spec_endpoint:
            config = json.loads(costmodel.speculative_config(str(eagle_dir), out["best"][0]["k"]))
            spec_endpoint = servers.enter_context(launch.vllm(command, resolve_target(spec.target), config))
        if endpoint and spec_endpoint:
            out["live_endpoints"] = {"endpoint": endpoint, "spec_endpoint": spec_endpoint,
                                     "started": [name for name, given in (("plain", spec.endpoint),
                                                                          ("spec", spec.spec_endpoint)) if not given]}
            out["live_check"] = serving.live_check(prompts, spec.max_new_tokens, endpoint, spec_endpoint, times,
                                                   per_k, api_key)
    return out


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
        if name.split("/", 1)[0] in EXPORT_DIRS or name == HISTORY:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            fetch_verified(art, manifest, name, dest / name)
    if not (dest / EAGLE_DIR / "config.json").is_file():
        raise ValueError(f"drafter {uri} has no eagle/ export (config.json + model.safetensors)")
    return manifest


def _local_or_uri(uri: str) -> str:
    """Where a server reads an export from: the path of a file:// URI, else the URI (copy it near the server)."""
    return unquote(urlparse(uri).path) if uri.startswith("file://") else uri


def run(spec: Spec, ctx: StageContext) -> StageResult:
    torch.manual_seed(0)
    drafter_uri = open_artifact(spec.drafter, ctx.settings).uri
    with tempfile.TemporaryDirectory(prefix="eyas-eval-") as tmp:
        local = Path(tmp)
        manifest = _fetch_drafter(spec.drafter, local, ctx.settings)
        if not manifest.layout or manifest.drafter is None:
            raise ValueError(f"drafter {spec.drafter}: its manifest lacks the layout or the training facts")
        layout, facts = Layout.from_dict(manifest.layout), manifest.drafter
        place = placement(ctx.settings, spec.dtype)
        target = load_target(spec.target, place)
        engines = tuple(e for e in spec.engines if e not in facts.unsupported_engines)
        wiring = check_wiring(layout, local, target, engines)
        wiring["unsupported"] = {e: why for e, why in facts.unsupported_engines.items() if e in spec.engines}
        # on the target's input device (where its embedding is), in the target's dtype, as vLLM serves it
        drafter, _ = load_drafter(local / EAGLE_DIR, target.model.get_input_embeddings().weight.detach(), place.dtype)
        history = json.loads((local / HISTORY).read_text()) if (local / HISTORY).is_file() else None

        trained_on = manifest.inputs[0] if manifest.inputs else None  # the drafter's training features
        checked = check_held_out(spec.prompts, spec.num_prompts, trained_on, ctx.settings)
        ctx.metrics.update(held_out_prompts_checked=checked)
        features_uri = spec.features or trained_on
        steps = max(spec.k, facts.ttt_steps)
        accuracy, acc_samples = [], 0
        if features_uri:
            reader = FeatureReader(open_artifact(features_uri, ctx.settings), expected=layout)
            val_every = None if spec.features else facts.val_every
            accuracy, acc_samples = teacher_forced_accuracy(
                drafter, target.model.get_output_embeddings().weight.detach(), reader, val_every, steps,
                spec.batch_tokens)
        ctx.metrics.update(per_position_accuracy=accuracy)

        prompts = eval_prompts(target.tokenizer, spec.prompts, spec.num_prompts, facts.chat_template_kwargs)
        outputs, runs, per_k = _replayed(target, drafter, layout, prompts, spec.max_new_tokens, spec.k)
        scored = per_k[spec.k]
        n_decode = min(spec.decode_prompts or len(prompts), len(prompts))
        decoded = measure_acceptance(target, drafter, layout.aux_layers, prompts[:n_decode], spec.k,
                                     spec.max_new_tokens, references=outputs[:n_decode],
                                     progress=lambda done, total: ctx.progress(done, total, "prompts decoded"))
        replayed = chain_acceptance(runs[:n_decode], spec.k)
        decoded["replay_matches"] = (replayed["drafts"], replayed["accepted_per_pos"]) == (
            decoded["drafts"], decoded["accepted_per_pos"])
        if decoded["greedy_mismatches"]:
            log.warning("speculative output differs from plain greedy for %s", decoded["greedy_mismatches"])
        if not decoded["replay_matches"]:
            log.warning("decoding counted %s drafts / %s accepted, the replay %s / %s", decoded["drafts"],
                        decoded["accepted_per_pos"], replayed["drafts"], replayed["accepted_per_pos"])
        for tie in decoded["near_ties"]:
            log.info("near tie (%s dtype) at %s", place.dtype_name, tie)
        live = None
        if spec.endpoint or spec.spec_endpoint:
            key = ctx.settings.endpoint_api_key  # from the settings: a spec never carries one (eyas.confine)
            live = live_ab(prompts, spec.max_new_tokens, spec.endpoint, spec.spec_endpoint, spec.concurrency,
                           api_key=key.get_secret_value() if key else None)
            for run_ in ("baseline", "speculative"):
                if run_ in live:  # token ids are compared here, not stored
                    live[run_]["matches_in_process_greedy"] = live[run_].pop("outputs") == outputs
        second = _second_set(spec, ctx.settings, target, drafter, layout, trained_on, facts.chat_template_kwargs)
        served = _serving(spec, ctx, target, drafter, prompts, per_k, local / EAGLE_DIR,
                          _local_or_uri(f"{drafter_uri}/{EAGLE_DIR}"))

    report = {
        "target": spec.target,
        "layout": layout.to_dict(),
        "k": spec.k,
        "per_position_accuracy": accuracy,
        "acceptance_length": scored["acceptance_length"],
        "per_position_acceptance": scored["per_position_acceptance"],
        "acceptance": {"drafts": scored["drafts"], "accepted_per_pos": scored["accepted_per_pos"],
                       "prompts": len(prompts), "max_new_tokens": spec.max_new_tokens,
                       "method": "the target's greedy output, one teacher-forced pass per prompt replayed as "
                                 "K-chains",
                       "per_category": _per_category(prompts, runs, spec.k),
                       "per_prompt": _per_prompt(prompts, outputs, runs, spec.k)},
        "exports": {name: f"{drafter_uri}/{name}" for name in EXPORT_DIRS if f"{name}/config.json" in manifest.files},
        # what the server must render prompts with for the drafter to see what it was trained on
        "serve_with": {"chat_template_kwargs": facts.chat_template_kwargs},
        "expected_acceptance_length": reports.expected_acceptance_length(accuracy, spec.k) if accuracy else None,
        "acceptance_gap": _gap(accuracy, scored["per_position_acceptance"], spec.k),
        "second_set": second,
        "drafter": drafter_uri,
        "features": {"uri": features_uri, "split": "all" if spec.features else "validation",
                     "samples": acc_samples, "ttt_steps": steps},
        "prompts": {"source": spec.prompts, "count": len(prompts), "turn": "first user turn"},
        "wiring": wiring,
        "in_process": {key: v for key, v in decoded.items() if key != "per_prompt"},
        "per_prompt": decoded["per_prompt"],
        "training": manifest.metrics,
        "compute": {"device": str(target.input_device), "dtype": place.dtype_name},
    }
    if live is not None:
        report["live"] = live
    report["serving"] = served
    files = reports.build(report, history)
    writer = ArtifactWriter(ctx.output)
    for name, data in files.items():
        writer.put_bytes(name, data)
    metrics = {"acceptance_length": scored["acceptance_length"], "k": spec.k,
               "per_position_acceptance": scored["per_position_acceptance"], "per_position_accuracy": accuracy,
               "matches_greedy": decoded["matches_greedy"], "replay_matches_decoding": decoded["replay_matches"],
               "serving_decision": served["decision"]}
    if second and "acceptance_length" in second:
        metrics["second_set_acceptance_length"] = second["acceptance_length"]
    if live is not None:
        metrics.update({f"live_{k}": v for k, v in (live.get("speculative") or {}).items()
                        if k in ("acceptance_length", "per_position_acceptance", "tok_s")})
        if "speedup" in live:
            metrics["live_speedup"] = live["speedup"]
    writer.commit(Manifest(kind="report", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
                           inputs=[drafter_uri] + ([features_uri] if features_uri else []),
                           counts={"prompts": len(prompts), "drafts": scored["drafts"],
                                   "accepted": sum(scored["accepted_per_pos"]), "decoded_prompts": n_decode,
                                   "accuracy_samples": acc_samples},
                           layout=layout.to_dict(), metrics=metrics))
    out = ctx.output.uri
    return StageResult(output_uri=out, metrics=metrics,
                       artifacts={"report_json": f"{out}/report.json", "report_html": f"{out}/report.html"})

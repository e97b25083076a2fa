"""Extractor stage: conversations → rendered tokens + loss masks → target forward with aux capture → shards.

Each conversation becomes one sample per group of assistant turns that share the context the server saw
(eyas.render: a template that drops earlier reasoning gives one sample per such turn), rendered with the chat
template kwargs the dataset was generated with (recorded again in the features manifest). The policies that
skip or truncate samples are in services.extractor.plan, the capture and the shard files in
services.extractor.shards, the job's spec in services.extractor.spec.

Every GPU of the node works: a target that fits one GPU is extracted by one process per GPU under torchrun
(`processes`; default one per visible GPU), each writing its share of the planned shards into the one artifact;
a larger target is spread over all GPUs and extracted by one process.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from eyas.capture import Captured
from eyas.coordination import LocalWork, Work
from eyas.datasets import read_conversations
from eyas.device import Placement, placement
from eyas.features import layout_token_bytes, shard_name
from eyas.handoff import INDEX, HandoffPlan, abort, read_plan
from eyas.layout import BF16, Layout, aux_layers_for
from eyas.manifest import ArtifactWriter, FeaturesFacts, FileEntry, Manifest
from eyas.ranks import run_ranks
from eyas.settings import Settings
from eyas.stage import StageContext, StageResult
from eyas.store import Artifact
from eyas.target import (
    Target,
    config_hash,
    device_map,
    load_target,
    load_tokenizer,
    precision,
    resolve_target,
    tokenizer_hash,
    weight_bytes,
)
from services.extractor.handoff import (
    announce,
    objects,
    plan_index,
    published,
    published_files,
    stream_plan,
    work,
)
from services.extractor.plan import Plan, make_plan
from services.extractor.shards import Uploaded, hooked, write_shards
from services.extractor.spec import Spec
from services.extractor.vllm_backend import EngineConfig, EngineUnavailable, extract_with_vllm

log = logging.getLogger(__name__)
INPUT_FIELD = "data"
# stdout lines of the torchrun ranks (services.extractor.rank) that this process reads
PROGRESS_TAG = "EYAS-EXTRACT-PROGRESS "  # + tokens a rank's forward passes just covered
FILES_TAG = "EYAS-EXTRACT-FILES "  # + JSON {shard name: its manifest entry}, once a rank has uploaded its shards


def layout_for(target: Target, aux_layers: list[int] | None) -> Layout:
    """The layout of states captured from this loaded target (at its precision)."""
    return dataclasses.replace(target_layout(target.name, target.tokenizer, aux_layers), precision=target.precision)


def target_layout(name: str, tokenizer, aux_layers: list[int] | None, dtype: str = BF16,
                  compute_dtype: str | None = None) -> Layout:
    """The features' layout for target `name`, from its config and tokenizer (no weights loaded), stored in
    `dtype` (eyas.layout.FEATURE_DTYPES), captured with the target computing in `compute_dtype` (its precision:
    that and the checkpoint's quantization; None: not recorded)."""
    from transformers import AutoConfig

    path = resolve_target(name)
    config = AutoConfig.from_pretrained(path)
    aux, rule = aux_layers_for(config.num_hidden_layers, getattr(config, "layer_types", None), aux_layers)
    raw = json.loads((path / "config.json").read_text())
    return Layout(target=name, target_config_hash=config_hash(path), tokenizer_hash=tokenizer_hash(tokenizer),
                  num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                  vocab_size=config.vocab_size, aux_layers=aux, dtype=dtype, aux_rule=rule,
                  precision=precision(raw, compute_dtype) if compute_dtype else "")


@dataclass
class Job:
    """What every process of an extract job computes alike from its spec (services.extractor.plan)."""

    layout: Layout
    plan: Plan
    source: Manifest  # the conversations' manifest
    template_kwargs: dict
    row: int  # bytes a token takes in a shard (eyas.features.token_bytes)


def prepare(spec: Spec, settings: Settings) -> Job:
    tokenizer = load_tokenizer(spec.target)
    layout = target_layout(spec.target, tokenizer, spec.aux_layers, spec.features_dtype,
                           placement(settings, spec.dtype).dtype_name)
    records, source = read_conversations(spec.data, settings, expect_tokenizer_hash=layout.tokenizer_hash)
    template_kwargs = source.dataset.chat_template_kwargs if source.dataset else {}
    row = layout_token_bytes(layout)
    plan = make_plan(records, tokenizer, template_kwargs, max_length=spec.max_length, overlong=spec.overlong,
                     batch_tokens=spec.batch_tokens, row=row, shard_max_bytes=spec.shard_mb << 20)
    return Job(layout, plan, source, template_kwargs, row)


def processes(spec: Spec, place: Placement) -> int:
    """The spec's count, or one per visible GPU when the target fits one (else 1: it spreads over them all)."""
    if place.device.type != "cuda":
        return spec.processes or 1
    gpu = torch.cuda.get_device_properties(place.device).total_memory
    fits = device_map(weight_bytes(resolve_target(spec.target), place.dtype), gpu, place.device) != "auto"
    if spec.processes is None:
        return torch.cuda.device_count() if fits else 1
    if spec.processes > 1 and not fits:
        raise ValueError(f"target {spec.target!r} does not fit one GPU: it is spread over all of them, so one "
                         f"process extracts (processes=1), not {spec.processes}")
    return spec.processes


def _extract_distributed(spec: Spec, n: int, ctx: StageContext, total: int) -> dict[str, FileEntry]:
    """torchrun with `n` ranks (services.extractor.rank), each extracting every n-th shard of the same plan; their
    progress lines become this job's progress, their file lines the artifact's files. A cancel stops them all."""
    files: dict[str, FileEntry] = {}
    done = 0

    def relay(line: str) -> bool:
        nonlocal done
        if line.startswith(PROGRESS_TAG):
            done += int(line[len(PROGRESS_TAG):])
            ctx.metrics.update(tokens=done)
            ctx.progress(done, total, "tokens")
        elif line.startswith(FILES_TAG):
            files.update({k: FileEntry(**v) for k, v in json.loads(line[len(FILES_TAG):]).items()})
        else:
            return False
        return True

    run_ranks("services.extractor.rank", n, ["--spec", spec.model_dump_json(), "--output", ctx.output.uri], relay,
              "extractor processes", check=ctx.check)
    return files


def shard_work(stream: HandoffPlan | None, plan: Plan, output: Artifact, rank: int, world: int, settings: Settings,
               cancelled, claims: Work | None = None) -> tuple[Iterable[tuple[int, str]], Uploaded | None]:
    """This process's shards, and what to do once each is uploaded: every world-th of the plan's from rank; or of
    a stream's objects, those `claims` hands out (default: every world-th from rank), each published."""
    if stream is None:
        return ((i, shard_name(i)) for i in range(rank, len(plan.shards), world)), None
    claims = claims or LocalWork(objects(stream)[rank::world])
    return work(stream, output, claims, settings.stream_stall_s, cancelled), published(output, claims)


def engine_for(spec: Spec, settings: Settings) -> str:
    """The engine that runs the target: the spec's, else the deployment's, else vllm where installed."""
    if spec.engine != "auto":
        return spec.engine
    if settings.extract_engine is not None:
        return settings.extract_engine
    return "vllm" if settings.vllm_python is not None and settings.vllm_python.exists() else "transformers"


def engine_config(spec: Spec, place: Placement, job: Job, settings: Settings) -> EngineConfig:
    if settings.vllm_python is None or not settings.vllm_python.exists():
        raise EngineUnavailable(f"no vLLM environment here (EYAS_VLLM_PYTHON={settings.vllm_python}): run "
                                "scripts/install-vllm.sh, or set EYAS_VLLM_PYTHON to vLLM's interpreter")
    gpus = torch.cuda.device_count() if place.device.type == "cuda" else 1
    return EngineConfig(python=str(settings.vllm_python), target=str(resolve_target(spec.target)),
                        aux_layers=job.layout.aux_layers, num_layers=job.layout.num_layers, dtype=place.dtype_name,
                        tensor_parallel_size=spec.tensor_parallel_size or gpus, max_model_len=spec.max_length + 1)


def _extract_here(spec: Spec, place: Placement, job: Job, ctx: StageContext, stream: HandoffPlan | None,
                  writer: ArtifactWriter, claims: Work | None, total: int, helper: bool = False) -> dict[str, Any]:
    """Extract in this process, or on its vLLM engine (its share of a stream's objects: `claims`; a helper counts
    its tokens into the run's shared stats before each shard is published). What ran, for the manifest."""
    bar = tqdm(total=total, desc="extract", unit="tok", unit_scale=True)
    done = 0

    def progress(tokens: int) -> None:
        nonlocal done
        done += tokens
        bar.update(tokens)
        ctx.metrics.update(tokens=done)
        if helper:
            claims.add_stats({"tokens": tokens})
        ctx.progress(done, total, "tokens")

    # taken lazily: an engine that cannot start has taken none, and the fallback takes them all
    items, uploaded = shard_work(stream, job.plan, ctx.output, 0, 1, ctx.settings, ctx.stop.is_set, claims)
    if engine_for(spec, ctx.settings) == "vllm":
        try:
            config = engine_config(spec, place, job, ctx.settings)
            files, engine_log = extract_with_vllm(config, ctx.output.uri, job.layout.dtype, job.plan.shards, items,
                                                  progress, uploaded, ctx.check, ctx.settings.workdir / "logs")
            writer.files.update(files)
            bar.close()
            return {"engine": "vllm", "device": place.device.type, "tensor_parallel_size": config.tensor_parallel_size,
                    "engine_log": str(engine_log)}
        except EngineUnavailable as e:  # raised before any shard was taken
            if spec.engine == "vllm":
                raise
            log.warning("extracting with transformers: %s", e)
    target = load_target(spec.target, place)
    write_shards(hooked(target, job.layout, ctx.check), Captured(job.layout.target, job.layout.aux_layers),
                 job.plan.shards, items, writer, progress, uploaded, job.layout.dtype)
    bar.close()
    return {"engine": "transformers", "device": str(target.input_device), "processes": 1}


def run(spec: Spec, ctx: StageContext) -> StageResult:
    place = placement(ctx.settings, spec.dtype)
    # "auto" resolved here, once: every process and the manifest see the same dtype
    spec = spec.model_copy(update={"dtype": place.dtype_name})
    job = prepare(spec, ctx.settings)
    plan, layout = job.plan, job.layout
    n = 1 if engine_for(spec, ctx.settings) == "vllm" else processes(spec, place)
    writer = ArtifactWriter(ctx.output)
    writer.put_bytes(INDEX, plan_index(plan).to_bytes())  # what a trainer plans from
    stream = None
    if spec.stream is not None:
        stream = stream_plan(spec.stream, plan, layout.to_dict(), job.row, job.template_kwargs)
        announce(stream, writer)
        ctx.hand_off()  # a train job in `then` may start on the shards as they land
    total = plan.counts["tokens"] * (stream.epochs if stream else 1)
    # a stream's objects, shared with up to max_workers - 1 helpers where the deployment has them
    claims = ctx.share(objects(stream), spec.max_workers - 1, 1, True) if stream and n == 1 else None
    try:
        if n == 1:
            shards = ArtifactWriter(ctx.output) if stream else writer  # a stream's shards are listed by their markers
            compute = _extract_here(spec, place, job, ctx, stream, shards, claims, total)
        else:
            files = _extract_distributed(spec, n, ctx, total)
            if stream is None:
                writer.files.update(files)
            compute = {"engine": "transformers", "device": place.device.type, "processes": n}
        helped = claims.shared_stats().get("tokens", 0) if claims else 0
    except Exception as e:
        if stream is not None:  # the trainer stops waiting for shards that will not come
            abort(ctx.output, "extractor", f"{type(e).__name__}: {e}")
        raise
    finally:
        if claims is not None:
            claims.close()
    if stream is not None:
        writer.files.update(published_files(stream, ctx.output))
    missing = set() if stream else {shard_name(i) for i in range(len(plan.shards))} - writer.files.keys()
    if missing:
        raise RuntimeError(f"extractor processes did not report shards {sorted(missing)}")
    writer.put_bytes("samples.txt", ("\n".join(item.id for item in plan.samples) + "\n").encode())
    counts = plan.counts
    policy = {"overlong": spec.overlong, "features": stream.policy if stream else "cache"}
    manifest = writer.commit(Manifest(
        kind="features", id=ctx.job_id, job_spec=spec.model_dump(mode="json"), inputs=[spec.data],
        counts=counts, layout=layout.to_dict(), features=FeaturesFacts(chat_template_kwargs=job.template_kwargs),
        # forward_tokens: what this run's target forwards covered, its helpers' too (a recompute stream extracts
        # every epoch)
        metrics={**{k: counts[k] for k in ("samples", "tokens", "supervised_tokens")},
                 "forward_tokens": ctx.metrics.get("tokens", counts["tokens"]) + helped},
        extra={"source_manifest_id": job.source.id, "policy": policy,
               "compute": {**compute, "dtype": place.dtype_name}},
    ))
    log.info("features: %s samples, %s tokens in %s shards → %s", counts["samples"], counts["tokens"],
             counts["shards"], ctx.output.uri)
    return StageResult(output_uri=ctx.output.uri, metrics=manifest.metrics)


def assist(spec: Spec, ctx: StageContext, claims: Work) -> None:
    """A helper (service mode): extract the objects of the job's stream that `claims` hands out; the job's own run
    seals the artifact."""
    stream = read_plan(ctx.output)
    if stream is None:
        return
    place = placement(ctx.settings, spec.dtype)
    job = prepare(spec, ctx.settings)
    if stream_plan(spec.stream, job.plan, job.layout.to_dict(), job.row, job.template_kwargs) != stream:
        raise RuntimeError(f"{ctx.output.uri}: this worker plans another stream than the job announced (its code "
                           "or data differ)")
    _extract_here(spec, place, job, ctx, stream, ArtifactWriter(ctx.output), claims,
                  job.plan.counts["tokens"] * stream.epochs, helper=True)
    log.info("helped job %s: %d tokens extracted", ctx.job_id, ctx.metrics.get("tokens", 0))

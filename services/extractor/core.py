"""Extractor stage: conversations → rendered tokens + loss masks → target forward with aux capture → shards.

Policies (counted in the manifest):
  - a conversation longer than max_length is truncated (policy "truncate", default) or skipped ("skip");
  - a conversation whose assistant turns are all empty, or that has no supervised token, is skipped;
  - NaN/inf in any captured activation fails the job, naming the sample.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from tqdm import tqdm

from eyas.features import Sample, ShardBuffer, shard_name
from eyas.layout import Layout, default_aux_layers
from eyas.manifest import ArtifactWriter, Manifest
from eyas.render import render_conversation
from eyas.stages import StageContext, StageResult, StageSpec
from eyas.target import BUNDLED, Target, load_target
from services.extractor.capture import capture
from services.generator.dataset import read_conversations

log = logging.getLogger(__name__)
INPUT_FIELD = "data"


class Spec(StageSpec):
    data: str = Field(description="conversations artifact URI (s3://bucket/datasets/ID) or local directory")
    target: str = Field(BUNDLED, description="target model: HF directory or the bundled name")
    aux_layers: list[int] | None = Field(None, description="physical out(i) layers; default out(1), out(L//2-1), out(L-4)")
    max_length: int = Field(2048, ge=16, le=131072)
    overlong: Literal["truncate", "skip"] = "truncate"
    batch_tokens: int = Field(8192, ge=256, description="padded tokens per forward batch")
    shard_mb: int = Field(256, ge=1, le=4096)
    dtype: Literal["float32", "bfloat16"] = "float32"


class BadActivation(ValueError):
    pass


def layout_for(target: Target, aux_layers: list[int] | None) -> Layout:
    aux = tuple(sorted(aux_layers)) if aux_layers else default_aux_layers(target.num_layers)
    return Layout(target=target.name, target_config_hash=target.config_hash, tokenizer_hash=target.tokenizer_hash,
                  num_layers=target.num_layers, hidden_size=target.hidden_size,
                  vocab_size=target.config.vocab_size, aux_layers=aux)


def _batches(items: list[tuple[str, list[int], list[int]]], batch_tokens: int):
    """Group by length (longest first) so padding stays small; each batch ≤ batch_tokens padded tokens."""
    items = sorted(items, key=lambda x: -len(x[1]))
    batch: list = []
    for it in items:
        if batch and len(batch[0][1]) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(it)
    if batch:
        yield batch


def run(spec: Spec, ctx: StageContext) -> StageResult:
    dtype = getattr(torch, spec.dtype)
    target = load_target(spec.target, dtype=dtype)
    layout = layout_for(target, spec.aux_layers)
    records, source_manifest = read_conversations(spec.data, ctx.settings,
                                                  expect_tokenizer_hash=target.tokenizer_hash)

    counts = {"conversations": len(records), "samples": 0, "tokens": 0, "supervised_tokens": 0,
              "truncated": 0, "skipped_overlong": 0, "skipped_empty": 0, "shards": 0}
    items = []
    for rec in records:
        if not any((m.get("content") or m.get("reasoning_content")) for m in rec["messages"]
                   if m["role"] == "assistant"):
            counts["skipped_empty"] += 1
            continue
        r = render_conversation(target.tokenizer, rec["messages"], rec.get("chat_template_kwargs"))
        ids, mask = r.input_ids, r.loss_mask
        if len(ids) > spec.max_length:
            if spec.overlong == "skip":
                counts["skipped_overlong"] += 1
                continue
            ids, mask = ids[: spec.max_length], mask[: spec.max_length]
            counts["truncated"] += 1
        if sum(mask) == 0:
            counts["skipped_empty"] += 1
            continue
        items.append((rec["id"], ids, mask))

    total_tokens = sum(len(i[1]) for i in items)
    writer = ArtifactWriter(ctx.output)
    buf = ShardBuffer(max_bytes=spec.shard_mb << 20)
    ids_in_order: list[str] = []
    done = 0
    with tempfile.TemporaryDirectory(prefix="eyas-extract-") as tmp:
        def flush():
            path = Path(tmp) / shard_name(counts["shards"])
            counts["samples"] += buf.write(path)
            writer.put_file(path.name, path)
            path.unlink()
            counts["shards"] += 1

        bar = tqdm(total=total_tokens, desc="extract", unit="tok", unit_scale=True)
        for batch in _batches(items, spec.batch_tokens):
            T = len(batch[0][1])
            input_ids = torch.zeros(len(batch), T, dtype=torch.long)
            attn = torch.zeros(len(batch), T, dtype=torch.long)
            for b, (_, ids, _) in enumerate(batch):
                input_ids[b, : len(ids)] = torch.tensor(ids)
                attn[b, : len(ids)] = 1
            aux, final = capture(target, layout, input_ids, attn)
            for b, (sid, ids, mask) in enumerate(batch):
                n = len(ids)
                a, f = aux[b, :n], final[b, :n]
                if not (torch.isfinite(a).all() and torch.isfinite(f).all()):
                    raise BadActivation(f"sample {sid!r}: non-finite target activations (NaN/inf)")
                full = buf.add(Sample(input_ids=torch.tensor(ids), loss_mask=torch.tensor(mask),
                                      aux_hidden=a.clone(), final_hidden=f.clone()))
                ids_in_order.append(sid)
                counts["tokens"] += n
                counts["supervised_tokens"] += sum(mask)
                if full:
                    flush()
            done += sum(len(i[1]) for i in batch)
            ctx.metrics.update(tokens=done)
            ctx.progress(done, total_tokens, "tokens")
            bar.update(sum(len(i[1]) for i in batch))
        bar.close()
        if buf.samples:
            flush()
        writer.put_bytes("samples.txt", ("\n".join(ids_in_order) + "\n").encode())
    manifest = writer.commit(Manifest(
        kind="features", id=ctx.job_id, job_spec=spec.model_dump(mode="json"), inputs=[spec.data],
        counts=counts, layout=layout.to_dict(),
        extra={"source_manifest_id": source_manifest.id, "policy": {"overlong": spec.overlong},
               "metrics": {k: counts[k] for k in ("samples", "tokens", "supervised_tokens")}},
    ))
    log.info("features: %s samples, %s tokens in %s shards → %s", counts["samples"], counts["tokens"],
             counts["shards"], ctx.output.uri)
    return StageResult(output_uri=ctx.output.uri, metrics=manifest.extra["metrics"])

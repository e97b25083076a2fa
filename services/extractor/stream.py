"""The extractor's side of a features hand-off (eyas.handoff): announce the stream before any forward pass, then
produce its shards in the announced order — waiting, under recompute, until the trainer has consumed the window two
before — and publish each one once it is uploaded.

A run taken over after a crash announces the same stream again (the plan is a function of the spec and the data)
and skips every shard already published or already consumed, so no sample is extracted twice for one epoch and
none is lost.
"""
from __future__ import annotations

from collections.abc import Iterator

from eyas.features import Index, shard_bytes, shard_name
from eyas.handoff import (
    FINISHED,
    READY,
    STREAM,
    ShardPlan,
    StreamPlan,
    consumed_marker,
    is_ready,
    read_plan,
    wait_for,
)
from eyas.manifest import ArtifactWriter, FileEntry
from eyas.store import Artifact
from services.extractor.plan import Plan
from services.extractor.spec import StreamSpec


def stream_plan(spec: StreamSpec, plan: Plan, layout: dict, width: int, chat_template_kwargs: dict) -> StreamPlan:
    shards = [ShardPlan(name=shard_name(i), samples=sum(len(b) for b in batches),
                        bytes=sum(shard_bytes(len(item.input_ids), width) for b in batches for item in b))
              for i, batches in enumerate(plan.shards)]
    window = int(spec.max_store_gb * (1 << 30)) // 2
    largest = max((s.bytes for s in shards), default=0)
    if largest > window:  # a window holds whole shards: the cap would not hold
        raise ValueError(f"stream.max_store_gb={spec.max_store_gb:g} holds two windows of {window / (1 << 20):.1f} "
                         f"MiB, and a planned shard takes {largest / (1 << 20):.1f} MiB: lower shard_mb or "
                         "batch_tokens (a shard closes at the first forward batch past shard_mb), or raise the cap")
    return StreamPlan(policy=spec.policy, epochs=spec.epochs if spec.policy == "recompute" else 1, seed=spec.seed,
                      window_bytes=window, layout=layout,
                      chat_template_kwargs=chat_template_kwargs, shards=shards)


def plan_index(plan: Plan) -> Index:
    return Index.of([[(item.input_ids, item.loss_mask) for batch in shard for item in batch] for shard in plan.shards])


def announce(stream: StreamPlan, writer: ArtifactWriter) -> None:
    """Write the announcement (after the index: a reader that sees stream.json finds the index). A run taken over
    must announce what the first one did."""
    before = read_plan(writer.artifact)
    if before is not None and before != stream:
        raise RuntimeError(f"{writer.artifact.uri}: announced a different stream before (the job's spec or data "
                           "changed between runs)")
    writer.put_bytes(STREAM, stream.model_dump_json().encode())


def work(stream: StreamPlan, artifact: Artifact, rank: int, world: int, stall_s: float,
         cancelled=lambda: False) -> Iterator[tuple[int, str]]:
    """(plan shard index, object) of this process's share of the stream, in order: every world-th item from rank,
    skipping what is published or consumed, each yielded once the store may take it; ends early when the trainer
    has finished."""
    sequence = stream.sequence()
    index_of = {s.name: i for i, s in enumerate(stream.shards)}
    window_of = {g: (epoch, w) for g, epoch, w, _ in sequence}
    for g, epoch, w, name in sequence[rank::world]:
        if artifact.exists(FINISHED):
            return
        obj = stream.object_name(epoch, name)
        if is_ready(artifact, obj) or artifact.exists(consumed_marker(epoch, w)):
            continue
        if stream.policy == "recompute" and g >= 2:
            gone = consumed_marker(*window_of[g - 2])
            if not wait_for(artifact, gone, f"the trainer to consume window {g - 2}", stall_s, cancelled,
                            unless=FINISHED):
                return
        yield index_of[name], obj


def published_files(stream: StreamPlan, artifact: Artifact) -> dict[str, FileEntry]:
    """What a sealed first_epoch stream keeps: every shard's entry, from its ready marker."""
    if stream.policy != "first_epoch":
        return {}
    return {name: FileEntry.model_validate_json(artifact.get_bytes(READY + name + ".json")) for name in stream.sizes}


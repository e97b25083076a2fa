"""The extractor's side of a features hand-off (eyas.handoff): announce the stream before any forward pass, then
produce its shards in the announced order — waiting, under recompute, until the trainer has consumed the window two
before — and publish each one once it is uploaded.

A run taken over after a crash announces the same stream again (the plan is a function of the spec and the data)
and skips every shard already published or already consumed, so no sample is extracted twice for one epoch and
none is lost.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from eyas.coordination import Work
from eyas.features import Index, shard_file_bytes, shard_name
from eyas.handoff import (
    FINISHED,
    POLL_S,
    READY,
    STREAM,
    HandoffAborted,
    HandoffPlan,
    ShardPlan,
    consumed_marker,
    is_ready,
    publish,
    read_plan,
    wait_for,
)
from eyas.manifest import ArtifactWriter, FileEntry
from eyas.store import Artifact
from services.extractor.plan import Plan
from services.extractor.spec import StreamSpec


def stream_plan(spec: StreamSpec, plan: Plan, layout: dict, row: int, chat_template_kwargs: dict) -> HandoffPlan:
    shards = [ShardPlan(name=shard_name(i), samples=sum(len(b) for b in batches),
                        bytes=shard_file_bytes(sum(len(item.input_ids) for b in batches for item in b),
                                               sum(len(b) for b in batches), row))
              for i, batches in enumerate(plan.shards)]
    window = int(spec.max_store_gb * (1 << 30)) // 2
    largest = max((s.bytes for s in shards), default=0)
    if largest > window:  # a window holds whole shards: the cap would not hold
        raise ValueError(f"stream.max_store_gb={spec.max_store_gb:g} holds two windows of {window / (1 << 20):.1f} "
                         f"MiB, and a planned shard takes {largest / (1 << 20):.1f} MiB: lower shard_mb (a "
                         "sample bigger than shard_mb takes a shard of its own: lower max_length), or raise the cap")
    return HandoffPlan(policy=spec.policy, epochs=spec.epochs if spec.policy == "recompute" else 1, seed=spec.seed,
                      window_bytes=window, layout=layout,
                      chat_template_kwargs=chat_template_kwargs, shards=shards)


def plan_index(plan: Plan) -> Index:
    return Index.of([[(item.input_ids, item.loss_mask) for batch in shard for item in batch] for shard in plan.shards])


def announce(stream: HandoffPlan, writer: ArtifactWriter) -> None:
    """Write the announcement (after the index: a reader that sees stream.json finds the index). A run taken over
    must announce what the first one did."""
    before = read_plan(writer.artifact)
    if before is not None and before != stream:
        raise RuntimeError(f"{writer.artifact.uri}: announced a different stream before (the job's spec or data "
                           "changed between runs)")
    writer.put_bytes(STREAM, stream.model_dump_json().encode())


def objects(stream: HandoffPlan) -> list[str]:
    """Every object the stream produces, in order: the ids of its Work (eyas.coordination)."""
    return [stream.object_name(epoch, name) for _, epoch, _, name in stream.sequence()]


def work(stream: HandoffPlan, artifact: Artifact, claims: Work, stall_s: float,
         cancelled=lambda: False) -> Iterator[tuple[int, str]]:
    """(plan shard index, object) of the objects `claims` hands this process, in the stream's order, skipping what
    is published or consumed, each yielded once the store may take it; ends when nothing is left to claim and
    nobody else holds any (or early, when the trainer has finished). The caller reports each object finished once
    published (`published`)."""
    index_of = {s.name: i for i, s in enumerate(stream.shards)}
    where = {stream.object_name(epoch, name): (g, epoch, w, name) for g, epoch, w, name in stream.sequence()}
    window_of = {g: (epoch, w) for g, epoch, w, _ in where.values()}
    delay = POLL_S[0]
    while not artifact.exists(FINISHED):
        obj = claims.claim()
        if obj is None:
            if claims.open_count() == 0:
                return
            if cancelled():  # others still extract their objects: wait for them before the run seals
                raise HandoffAborted(f"{artifact.uri}: stopped waiting for the other extract workers")
            time.sleep(delay)
            delay = min(POLL_S[1], delay * 1.5)
            continue
        delay = POLL_S[0]
        g, epoch, w, name = where[obj]
        if is_ready(artifact, obj) or artifact.exists(consumed_marker(epoch, w)):
            claims.finished([obj])
            continue
        if stream.policy == "recompute" and g >= 2:
            gone = consumed_marker(*window_of[g - 2])
            if not wait_for(artifact, gone, f"the trainer to consume window {g - 2}", stall_s, cancelled,
                            unless=FINISHED):
                return
        yield index_of[name], obj


def published(artifact: Artifact, claims: Work) -> Callable[[str, FileEntry], None]:
    """The uploaded-shard callback of a stream: publish its ready marker, then tell `claims` it is done."""

    def uploaded(obj: str, entry: FileEntry) -> None:
        publish(artifact, obj, entry)
        claims.finished([obj])

    return uploaded


def published_files(stream: HandoffPlan, artifact: Artifact) -> dict[str, FileEntry]:
    """What a sealed first_epoch stream keeps: every shard's entry, from its ready marker."""
    if stream.policy != "first_epoch":
        return {}
    return {name: FileEntry.model_validate_json(artifact.get_bytes(READY + name + ".json")) for name in stream.sizes}


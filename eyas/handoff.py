"""Features handed from extraction to training while both run: the contract between the two sides.

An extract job with a stream policy announces its features before the first forward pass and publishes each shard
as it lands; a train job started on the same artifact trains on the shards in the announced order, waiting for
those not yet there. Everything goes through the artifact's prefix in the object store:

  stream.json            the announcement (HandoffPlan): policy, epochs, the order's seed, window size, layout, and
                         each shard's name, planned bytes and samples, in artifact order
  index.safetensors      every sample's tokens and loss mask (eyas.features.Index): what the trainer plans
                         from — split, lengths, vocabulary counts, steps — before any feature exists
  <object>               a shard, uploaded whole (an S3 put, or a local write then rename)
  ready/<object>.json    its FileEntry (sha256, bytes), written after it: the shard may be read
  consumed/<e>-<w>       the trainer finished window w of epoch e and committed a checkpoint past it
  aborted.json           either side gave up ({"side", "error"}): the other stops waiting
  finished.json          the trainer needs nothing more (it may end inside an epoch): the extractor stops

Policies:
  - first_epoch: epoch 0 is extracted once, in artifact order, and trained on as it lands (windows of
    `window_bytes`); the shards are kept, sealed by a features manifest, and later epochs read them as a stored
    artifact (eyas.streaming's windows of the trainer's cache).
  - recompute: every epoch is extracted again, in that epoch's order — the shards shuffled by (seed, epoch) and cut
    into windows of `window_bytes` —, each epoch's shards under their own prefix. The trainer deletes a window's
    shards once a checkpoint past it is committed, and the extractor starts a shard of global window g only after
    window g - 2 was consumed: the store never holds more than two windows (2 · window_bytes, the job's cap), plus
    one shard per extractor process in flight. A window holds whole shards, so the extractor refuses a planned
    shard larger than a window.
"""
from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel

from eyas.manifest import FileEntry
from eyas.store import Artifact
from eyas.windows import cut_windows, epoch_order

STREAM = "stream.json"
INDEX = "index.safetensors"
READY = "ready/"
CONSUMED = "consumed/"
ABORTED = "aborted.json"
FINISHED = "finished.json"
POLL_S = (0.05, 2.0)  # first and longest wait between two looks at the store


class HandoffAborted(RuntimeError):
    pass


class ShardPlan(BaseModel):
    name: str
    bytes: int  # planned: the file's size at most (eyas.features.shard_file_bytes)
    samples: int


class HandoffPlan(BaseModel):
    policy: Literal["first_epoch", "recompute"]
    epochs: int  # epochs extracted (first_epoch: 1, whatever the trainer's)
    seed: int  # recompute: shards are shuffled by (seed, epoch)
    window_bytes: int
    layout: dict
    chat_template_kwargs: dict = {}
    shards: list[ShardPlan]  # artifact order

    @property
    def sizes(self) -> dict[str, int]:
        return {s.name: s.bytes for s in self.shards}

    def windows(self, epoch: int) -> list[list[str]] | None:
        """The shards of `epoch` in the order they are produced, in windows; None for an epoch read from the
        kept shards (first_epoch after epoch 0)."""
        if self.policy == "first_epoch":
            return cut_windows(list(self.sizes), self.sizes, self.window_bytes) if epoch == 0 else None
        return cut_windows(epoch_order(list(self.sizes), self.seed, epoch), self.sizes, self.window_bytes)

    def object_name(self, epoch: int, shard: str) -> str:
        return shard if self.policy == "first_epoch" else f"epoch-{epoch:04d}/{shard}"

    def sequence(self) -> list[tuple[int, int, int, str]]:
        """(global window, epoch, window, shard) of everything the extractor produces, in order."""
        out, g = [], 0
        for epoch in range(self.epochs):
            for w, window in enumerate(self.windows(epoch) or []):  # None: an epoch not produced
                out += [(g, epoch, w, name) for name in window]
                g += 1
        return out


def read_plan(artifact: Artifact) -> HandoffPlan | None:
    return HandoffPlan.model_validate_json(artifact.get_bytes(STREAM)) if artifact.exists(STREAM) else None


def consumed_marker(epoch: int, w: int) -> str:
    return f"{CONSUMED}{epoch:04d}-{w:05d}"


def abort(artifact: Artifact, side: str, error: str) -> None:
    artifact.put_bytes(ABORTED, json.dumps({"side": side, "error": error[:2000]}).encode())


def _aborted(artifact: Artifact) -> None:
    if artifact.exists(ABORTED):
        why = json.loads(artifact.get_bytes(ABORTED))
        raise HandoffAborted(f"{artifact.uri}: the {why['side']} gave up: {why['error']}")


def wait_for(artifact: Artifact, name: str, what: str, stall_s: float, cancelled=lambda: False,
             unless: str | None = None) -> bool:
    """Wait until object `name` exists (True), or object `unless` does (False); raises HandoffAborted when the other
    side gave up, `cancelled()` says so, or nothing came for `stall_s` seconds."""
    delay, start = POLL_S[0], time.monotonic()
    while not artifact.exists(name):
        _aborted(artifact)
        if unless is not None and artifact.exists(unless):
            return False
        if cancelled():
            raise HandoffAborted(f"{artifact.uri}: stopped waiting for {what}")
        if time.monotonic() - start > stall_s:
            raise HandoffAborted(f"{artifact.uri}: {what} did not come within {stall_s:g} s")
        time.sleep(delay)
        delay = min(POLL_S[1], delay * 1.5)
    return True


def ready_entry(artifact: Artifact, obj: str, stall_s: float, cancelled=lambda: False) -> FileEntry:
    """The FileEntry of shard object `obj`, waiting until the extractor published it."""
    wait_for(artifact, READY + obj + ".json", f"shard {obj}", stall_s, cancelled)
    return FileEntry.model_validate_json(artifact.get_bytes(READY + obj + ".json"))


def publish(artifact: Artifact, obj: str, entry: FileEntry) -> None:
    artifact.put_bytes(READY + obj + ".json", entry.model_dump_json().encode())


def is_ready(artifact: Artifact, obj: str) -> bool:
    return artifact.exists(READY + obj + ".json")


def release(artifact: Artifact, plan: HandoffPlan, epoch: int, w: int) -> None:
    """(trainer, recompute) Window w of `epoch` is done and a checkpoint past it committed: delete its shards and
    say so. Idempotent, so a resumed trainer calls it again for every window before its position."""
    if artifact.exists(consumed_marker(epoch, w)):
        return
    windows = plan.windows(epoch)
    assert windows is not None, "a recompute plan produces every epoch"
    for name in windows[w]:
        obj = plan.object_name(epoch, name)
        artifact.store.delete_prefix(artifact.key(obj))
        artifact.store.delete_prefix(artifact.key(READY + obj + ".json"))
    artifact.put_bytes(consumed_marker(epoch, w), b"")


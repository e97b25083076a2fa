"""Extract planned shards: the capture forward per batch on the target's device, its states to the host on a side
stream, and the shard files checked, written and uploaded by a background thread (services.extractor.offload).
NaN/inf in any captured activation fails the job, naming the sample; so does a state that is all zeros for a sample
(eyas.capture.Captured.check_nonzero), naming the layer and the target."""
from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path

import torch

from eyas.capture import Captured, capture
from eyas.features import Sample, ShardBuffer
from eyas.layout import BF16, Layout
from eyas.manifest import ArtifactWriter, FileEntry
from eyas.target import Target
from services.extractor.offload import Background, Ready, to_host
from services.extractor.plan import Batch


class BadActivation(ValueError):
    pass


def padded(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, T], right-padded to the longest sample (T)."""
    T = len(batch[0].input_ids)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    for b, item in enumerate(batch):
        ids[b, : len(item.input_ids)] = torch.tensor(item.input_ids)
        mask[b, : len(item.input_ids)] = 1
    return ids, mask


def _add(buf: ShardBuffer, batch: Batch, ready: Ready, captured: Captured) -> None:
    """(writer thread) Each sample's rows of the batch's host states, checked, into the shard."""
    aux, final = ready()  # [B, T, n_aux·H], [B, T, H] bf16 on the host
    for b, item in enumerate(batch):
        n = len(item.input_ids)
        a, f = aux[b, :n], final[b, :n]
        if not (torch.isfinite(a).all() and torch.isfinite(f).all()):
            raise BadActivation(f"sample {item.id!r}: non-finite target activations (NaN/inf)")
        captured.check_nonzero(item.id, a, f)
        buf.add(Sample(input_ids=torch.tensor(item.input_ids), loss_mask=torch.tensor(item.loss_mask),
                       aux_hidden=a.clone(), final_hidden=f.clone()))  # clones: the padded batch can go


def _flush(buf: ShardBuffer, path: Path, obj: str, writer: ArtifactWriter, uploaded: Uploaded | None) -> None:
    """(writer thread) Write the shard file, upload it as `obj` (its sha256 into writer.files), remove it."""
    buf.write(path)
    writer.put_file(obj, path)
    path.unlink()
    if uploaded is not None:
        uploaded(obj, writer.files[obj])


Uploaded = Callable[[str, FileEntry], None]  # (object, its entry), once a shard is uploaded


# a forward batch → (aux [B, T, n_aux·H], final [B, T, H]), right-padded to its longest sample, on any device
Capture = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
Shards = Sequence[list[Batch]] | Mapping[int, list[Batch]]  # a plan's shards (Plan.shards), or some of them by index


def hooked(target: Target, layout: Layout, check: Callable[[], None] | None = None) -> Capture:
    """The transformers capture (eyas.capture: forward hooks on the layout's layers), `check()` (a cancel) before
    every layer of a forward: a batch at the default batch_tokens takes seconds on a CPU."""
    return lambda batch: capture(target, layout, *padded(batch), check=check)


def write_shards(capture_batch: Capture, captured: Captured, shards: Shards, work: Iterable[tuple[int, str]],
                 writer: ArtifactWriter, progress: Callable[[int], None], uploaded: Uploaded | None = None,
                 dtype: str = BF16) -> None:
    """Extract the planned shards named in `work` ((index into `shards`, object name) pairs, taken lazily: a
    producer may wait before yielding the next) into `writer`'s artifact with `capture_batch` (its states are
    `captured`'s), their states stored in `dtype` (the layout's);
    `progress(tokens)` after each batch's forward, `uploaded(obj, entry)` after each shard's upload."""
    with tempfile.TemporaryDirectory(prefix="eyas-extract-") as tmp, Background() as background:
        for index, obj in work:
            buf = ShardBuffer(dtype=dtype)
            for batch in shards[index]:
                aux, final = capture_batch(batch)
                background.submit(partial(_add, buf, batch, to_host(aux, final), captured))
                progress(sum(len(item.input_ids) for item in batch))
            path = Path(tmp) / obj.replace("/", "-")
            background.submit(partial(_flush, buf, path, obj, writer, uploaded))

"""Feature shards: the extractor writes them, the trainer and evaluator read them — through this module only.

A shard is one safetensors file holding several samples back to back (tensor names in eyas.layout):
  input_ids [T] int32, loss_mask [T] uint8, aux_hidden [T, n_aux·H] bf16, final_hidden [T, H] bf16,
  offsets [S+1] int64 (sample s = tokens offsets[s]:offsets[s+1]).
The features manifest carries the layout; `FeatureReader` refuses features whose layout is not the expected one.
"""
from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file

from eyas.handoff import INDEX, StreamPlan, read_plan, ready_entry
from eyas.layout import (
    AUX_HIDDEN,
    FEATURE_TENSORS,
    FINAL_HIDDEN,
    INPUT_IDS,
    LOSS_MASK,
    OFFSETS,
    Layout,
    check_layout,
)
from eyas.manifest import MANIFEST, Manifest, check_fetched, read_manifest
from eyas.store import Artifact


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] int64 (0/1)
    aux_hidden: torch.Tensor  # [T, n_aux·H]
    final_hidden: torch.Tensor  # [T, H]


def shard_bytes(tokens: int, width: int) -> int:
    """What `tokens` tokens take in a shard: `width` hidden values each (aux + final, bf16), id (int32), mask (uint8)."""
    return tokens * (width * 2 + 5)


SHARD_HEADER_BYTES = 1024  # safetensors' header of a shard's five tensors (about 450 bytes), at most


def shard_file_bytes(tokens: int, samples: int, width: int) -> int:
    """A shard file's size, at most, for `samples` samples of `tokens` tokens in all: their rows, the offsets,
    the header."""
    return shard_bytes(tokens, width) + 8 * (samples + 1) + SHARD_HEADER_BYTES


class ShardBuffer:
    """Accumulates samples and flushes a shard file when it passes `max_bytes`."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self.samples: list[Sample] = []
        self.nbytes = 0

    def add(self, s: Sample) -> bool:
        self.samples.append(s)
        self.nbytes += shard_bytes(s.input_ids.numel(), s.aux_hidden.shape[-1] + s.final_hidden.shape[-1])
        return self.nbytes >= self.max_bytes

    def write(self, path: Path) -> int:
        lengths = [s.input_ids.numel() for s in self.samples]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        tensors = {
            INPUT_IDS: torch.cat([s.input_ids for s in self.samples]).to(torch.int32),
            LOSS_MASK: torch.cat([s.loss_mask for s in self.samples]).to(torch.uint8),
            AUX_HIDDEN: torch.cat([s.aux_hidden for s in self.samples]).to(torch.bfloat16).contiguous(),
            FINAL_HIDDEN: torch.cat([s.final_hidden for s in self.samples]).to(torch.bfloat16).contiguous(),
            OFFSETS: offsets,
        }
        save_file(tensors, str(path))
        n = len(self.samples)
        self.samples, self.nbytes = [], 0
        return n


@dataclass
class Index:
    """Every sample's tokens and loss mask, without features (INDEX of a features artifact): what a trainer plans
    from before it reads, or before the extractor has written, any shard."""

    input_ids: torch.Tensor  # [T] int32, all samples back to back in artifact order
    loss_mask: torch.Tensor  # [T] uint8
    offsets: torch.Tensor  # [S+1] int64: sample s = tokens offsets[s]:offsets[s+1]
    shard_starts: torch.Tensor  # [n_shards+1] int64: shard k holds samples shard_starts[k]:shard_starts[k+1]

    @property
    def lengths(self) -> list[int]:
        return self._lengths().tolist()

    def _lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]  # [S]

    def supervised_counts(self, samples: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[V] int64: how often each id occurs at a supervised position of the samples `samples` ([N] bool)."""
        owner = torch.repeat_interleave(torch.arange(len(self.offsets) - 1), self._lengths())  # [T] sample of token
        keep = self.loss_mask.bool() & samples[owner]
        return torch.bincount(self.input_ids[keep].long(), minlength=vocab_size)

    def to_bytes(self) -> bytes:
        return save({"input_ids": self.input_ids, "loss_mask": self.loss_mask, "offsets": self.offsets,
                     "shard_starts": self.shard_starts})

    @classmethod
    def from_bytes(cls, data: bytes) -> Index:
        return cls(**load(data))

    @classmethod
    def of(cls, shards: list[list[tuple[list[int] | torch.Tensor, list[int] | torch.Tensor]]]) -> Index:
        """The index of shards given as their samples' (input_ids, loss_mask), in artifact order."""
        samples = [s for shard in shards for s in shard]
        lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.int64)

        def flat(i: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.cat([torch.as_tensor(s[i]).to(dtype) for s in samples]) if samples else torch.zeros(0, dtype=dtype)

        return cls(input_ids=flat(0, torch.int32), loss_mask=flat(1, torch.uint8),
                   offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                   shard_starts=torch.tensor([0] + [len(sh) for sh in shards], dtype=torch.int64).cumsum(0))


def is_validation(index: int, val_every: int) -> bool:
    """THE train/validation split: sample `index` (its order in the features artifact) is held out for validation
    iff index % val_every == 0. The trainer and the evaluator both split with this function."""
    return index % val_every == 0


SHARD_PREFIX = "shard-"


def shard_name(i: int) -> str:
    return f"{SHARD_PREFIX}{i:05d}.safetensors"


def shard_sample(t: dict[str, torch.Tensor], i: int) -> Sample:
    """Sample i of a shard's tensors (views into them)."""
    a, b = int(t[OFFSETS][i]), int(t[OFFSETS][i + 1])
    return Sample(input_ids=t[INPUT_IDS][a:b].long(), loss_mask=t[LOSS_MASK][a:b].long(),
                  aux_hidden=t[AUX_HIDDEN][a:b], final_hidden=t[FINAL_HIDDEN][a:b])


def shard_samples(t: dict[str, torch.Tensor]) -> Iterator[Sample]:
    for i in range(len(t[OFFSETS]) - 1):
        yield shard_sample(t, i)


class FeatureReader:
    """Reads a features artifact after checking its layout and every shard's sha256: a sealed one (its manifest
    lists the files), or one still being extracted (eyas.handoff: the announcement gives the shards, each shard's
    ready marker its sha256, and reading a shard waits for it)."""

    def __init__(self, artifact: Artifact, expected: Layout | None = None, cache_dir: Path | None = None,
                 stall_s: float = 3600.0, stop: threading.Event | None = None):
        self.artifact, self.stall_s = artifact, stall_s
        self.closing = threading.Event()  # set when the reader is done: a prefetch stops waiting
        self.stop = stop or threading.Event()  # set by the caller (a cancel): stop waiting as well
        self.stream: StreamPlan | None = read_plan(artifact)
        self.manifest: Manifest | None = None
        if self.stream is None or artifact.exists(MANIFEST):
            self.manifest = read_manifest(artifact, kind="features")
        layout = self.manifest.layout if self.manifest else self.stream.layout
        if not layout:
            raise ValueError(f"{artifact.uri}: features manifest carries no layout")
        self.layout = Layout.from_dict(layout)
        if expected is not None:
            check_layout(expected, self.layout, what=f"features {artifact.uri}")
        if self.stream is not None:
            self.sizes = self.stream.sizes
        else:
            self.sizes = {n: e.bytes for n, e in sorted(self.manifest.files.items()) if n.startswith(SHARD_PREFIX)}
        self.shards = list(self.sizes)  # artifact order
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="eyas-features-")
            cache_dir = Path(self._tmp.name)
        self.cache_dir = Path(cache_dir)

    @property
    def chat_template_kwargs(self) -> dict:
        if self.manifest is not None:
            return self.manifest.features.chat_template_kwargs if self.manifest.features else {}
        return self.stream.chat_template_kwargs

    def index(self) -> Index:
        return Index.from_bytes(self.artifact.get_bytes(INDEX))

    def fetch(self, obj: str, dest: Path) -> None:
        """Download shard object `obj` to `dest`, checked against its sha256 (the manifest's, else its ready
        marker's, waiting for that)."""
        entry = self.manifest.files.get(obj) if self.manifest else None
        if entry is None and self.stream is not None:
            entry = ready_entry(self.artifact, obj, self.stall_s,
                                lambda: self.closing.is_set() or self.stop.is_set())
        check_fetched(self.artifact, obj, entry, dest)

    def load_shard(self, name: str, local: Path | None = None) -> dict[str, torch.Tensor]:
        local = local or self.cache_dir / name
        if not local.exists():
            self.fetch(name, local)
        t = load_file(str(local))
        missing = [k for k in FEATURE_TENSORS if k not in t]
        if missing:
            raise ValueError(f"{self.artifact.uri}/{name}: missing tensors {missing}")
        width = len(self.layout.aux_layers) * self.layout.hidden_size
        if t[AUX_HIDDEN].shape[1:] != (width,) or t[FINAL_HIDDEN].shape[1:] != (self.layout.hidden_size,):
            raise ValueError(f"{self.artifact.uri}/{name}: tensor widths disagree with the layout")
        for key in (AUX_HIDDEN, FINAL_HIDDEN):  # NaN/inf would poison every step that sees it: name the sample
            bad = (~torch.isfinite(t[key])).any(dim=1).nonzero()
            if len(bad):
                sample = int(torch.searchsorted(t[OFFSETS], bad[0], right=True)[0]) - 1
                raise ValueError(f"{self.artifact.uri}/{name}: non-finite values (NaN/inf) in {key} of sample "
                                 f"{sample} of the shard (token {int(bad[0])})")
        return t

    def samples(self) -> Iterator[Sample]:
        for name in self.shards:
            yield from shard_samples(self.load_shard(name))

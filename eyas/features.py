"""Feature shards: the extractor writes them, the trainer and evaluator read them — through this module only.

A shard is one safetensors file holding several samples back to back (tensor names in eyas.layout):
  input_ids [T] int32, loss_mask [T] uint8, aux_hidden [T, n_aux·H], final_hidden [T, H],
  offsets [S+1] int64 (sample s = tokens offsets[s]:offsets[s+1]).
The hidden states are stored in the layout's dtype: bf16, or fp8 (e4m3) with a float32 scale per token and per
state beside them (aux_hidden_scale [T, n_aux], final_hidden_scale [T, 1]), about half the bytes. Every reader gets
bf16 samples either way: `shard_sample` dequantizes (q · scale).
The features manifest carries the layout; `FeatureReader` refuses features whose layout is not the expected one,
and a shard whose tensors are not stored as its layout says.
"""
from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, load_file, save, save_file

from eyas.handoff import INDEX, HandoffPlan, read_plan, ready_entry
from eyas.layout import (
    AUX_HIDDEN,
    AUX_SCALE,
    BF16,
    FEATURE_DTYPES,
    FEATURE_TENSORS,
    FINAL_HIDDEN,
    FINAL_SCALE,
    FP8,
    FP8_MAX,
    INPUT_IDS,
    LOSS_MASK,
    OFFSETS,
    SCALES,
    Layout,
    LayoutMismatch,
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


def token_bytes(width: int, states: int = 1, dtype: str = BF16) -> int:
    """What a token takes in a shard: `width` hidden values over `states` states (aux layers + final) in `dtype`
    (bf16: 2 bytes each; fp8: 1 byte each and a float32 scale per state), its id (int32) and mask (uint8)."""
    return (width * 2 if dtype == BF16 else width + 4 * states) + 5


def layout_token_bytes(layout: Layout) -> int:
    """What a token of features in `layout` takes in a shard."""
    states = len(layout.aux_layers) + 1
    return token_bytes(states * layout.hidden_size, states, layout.dtype)


def shard_bytes(tokens: int, row: int) -> int:
    """What `tokens` tokens take in a shard, `row` bytes each (token_bytes)."""
    return tokens * row


SHARD_HEADER_BYTES = 1024  # safetensors' header of a shard's tensors (about 400 bytes; 560 with fp8's scales)


def shard_file_bytes(tokens: int, samples: int, row: int) -> int:
    """A shard file's size, at most, for `samples` samples of `tokens` tokens in all, `row` bytes each
    (token_bytes): their rows, the offsets, the header."""
    return shard_bytes(tokens, row) + 8 * (samples + 1) + SHARD_HEADER_BYTES


def quantize(x: torch.Tensor, states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, states·H] → (fp8 e4m3 [T, states·H], float32 scale [T, states]): each state's row scaled to e4m3's
    range by its amax (a row of zeros: scale 0, values 0)."""
    rows = x.reshape(x.shape[0], states, -1)  # [T, states, H]
    low, high = torch.aminmax(rows, dim=-1)
    scale = torch.maximum(high, -low).float() / FP8_MAX  # [T, states]
    # a row whose scale is too small to invert in float32 (amax below ~5e-36) is stored as zeros: 0 · ∞ is NaN
    inverse = torch.where(scale > torch.finfo(torch.float32).tiny, 1 / scale, torch.zeros_like(scale))
    q = (rows.float() * inverse[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8 [T, states·H] and its scale [T, states] → [T, states·H] in `dtype`."""
    rows = q.float().reshape(q.shape[0], scale.shape[-1], -1).mul_(scale[..., None])
    return rows.reshape(q.shape).to(dtype)


class ShardBuffer:
    """Accumulates samples and flushes a shard file when it passes `max_bytes`; `dtype` is how the file stores
    the hidden states (eyas.layout.FEATURE_DTYPES: the features' Layout.dtype)."""

    def __init__(self, max_bytes: int = 256 << 20, dtype: str = BF16):
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"features dtype {dtype!r}: not one of {list(FEATURE_DTYPES)}")
        self.max_bytes, self.dtype = max_bytes, dtype
        self.samples: list[Sample] = []
        self.nbytes = 0

    def add(self, s: Sample) -> bool:
        self.samples.append(s)
        width = s.aux_hidden.shape[-1] + s.final_hidden.shape[-1]
        self.nbytes += shard_bytes(s.input_ids.numel(), token_bytes(width, width // s.final_hidden.shape[-1],
                                                                    self.dtype))
        return self.nbytes >= self.max_bytes

    def _hidden(self) -> dict[str, torch.Tensor]:
        if self.dtype == BF16:
            return {key: torch.cat([getattr(s, key) for s in self.samples]).to(torch.bfloat16).contiguous()
                    for key in (AUX_HIDDEN, FINAL_HIDDEN)}
        H = self.samples[0].final_hidden.shape[-1]
        out = {}
        for key in (AUX_HIDDEN, FINAL_HIDDEN):  # sample by sample: a float32 copy of one sample at a time
            parts = [quantize(getattr(s, key), getattr(s, key).shape[-1] // H) for s in self.samples]
            out[key] = torch.cat([q for q, _ in parts])
            out[SCALES[key]] = torch.cat([scale for _, scale in parts])
        return out

    def write(self, path: Path) -> int:
        lengths = [s.input_ids.numel() for s in self.samples]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        tensors = {
            INPUT_IDS: torch.cat([s.input_ids for s in self.samples]).to(torch.int32),
            LOSS_MASK: torch.cat([s.loss_mask for s in self.samples]).to(torch.uint8),
            **self._hidden(),
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
            return (torch.cat([torch.as_tensor(s[i]).to(dtype) for s in samples]) if samples
                    else torch.zeros(0, dtype=dtype))

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
    """Sample i of a shard's tensors: views into bf16 ones; fp8 ones (with their scales) dequantized to bf16."""
    a, b = int(t[OFFSETS][i]), int(t[OFFSETS][i + 1])

    def hidden(key: str) -> torch.Tensor:
        return dequantize(t[key][a:b], t[SCALES[key]][a:b]) if SCALES[key] in t else t[key][a:b]

    return Sample(input_ids=t[INPUT_IDS][a:b].long(), loss_mask=t[LOSS_MASK][a:b].long(),
                  aux_hidden=hidden(AUX_HIDDEN), final_hidden=hidden(FINAL_HIDDEN))


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
        self.stream: HandoffPlan | None = read_plan(artifact)
        self.manifest: Manifest | None = None
        if self.stream is None:
            self.manifest = read_manifest(artifact, kind="features")
            layout = self.manifest.layout
            self.sizes = {n: e.bytes for n, e in sorted(self.manifest.files.items()) if n.startswith(SHARD_PREFIX)}
        else:  # announced, so the plan gives the shards; the manifest, once the extractor finished
            self.manifest = read_manifest(artifact, kind="features") if artifact.exists(MANIFEST) else None
            layout = self.manifest.layout if self.manifest else self.stream.layout
            self.sizes = self.stream.sizes
        facts = self.manifest.features if self.manifest is not None else self.stream
        self.chat_template_kwargs: dict[str, Any] = facts.chat_template_kwargs if facts else {}
        if not layout:
            raise ValueError(f"{artifact.uri}: features manifest carries no layout")
        self.layout = Layout.from_dict(layout)
        if self.layout.dtype not in FEATURE_DTYPES:
            raise LayoutMismatch(f"features {artifact.uri} store their hidden states as {self.layout.dtype!r}, "
                                 f"which this reader does not read (it reads {list(FEATURE_DTYPES)})")
        if expected is not None:
            check_layout(expected, self.layout, what=f"features {artifact.uri}")
        self.shards = list(self.sizes)  # artifact order
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="eyas-features-")
            cache_dir = Path(self._tmp.name)
        self.cache_dir = Path(cache_dir)

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
        fp8 = self.layout.dtype == FP8
        missing = [k for k in FEATURE_TENSORS + ((AUX_SCALE, FINAL_SCALE) if fp8 else ()) if k not in t]
        if missing:
            raise ValueError(f"{self.artifact.uri}/{name}: missing tensors {missing}")
        for key in (AUX_HIDDEN, FINAL_HIDDEN):
            stored = str(t[key].dtype).removeprefix("torch.")
            if stored != self.layout.dtype:
                raise LayoutMismatch(f"{self.artifact.uri}/{name}: {key} is stored as {stored}, but the features' "
                                     f"layout says {self.layout.dtype}")
        n_aux, H = len(self.layout.aux_layers), self.layout.hidden_size
        if t[AUX_HIDDEN].shape[1:] != (n_aux * H,) or t[FINAL_HIDDEN].shape[1:] != (H,):
            raise ValueError(f"{self.artifact.uri}/{name}: tensor widths disagree with the layout")
        if fp8 and (t[AUX_SCALE].shape != (len(t[AUX_HIDDEN]), n_aux) or t[AUX_SCALE].dtype != torch.float32
                    or t[FINAL_SCALE].shape != (len(t[FINAL_HIDDEN]), 1) or t[FINAL_SCALE].dtype != torch.float32):
            raise ValueError(f"{self.artifact.uri}/{name}: the fp8 scales are not float32 [T, n_aux] and [T, 1]")
        for key in (AUX_HIDDEN, FINAL_HIDDEN):  # NaN/inf would poison every step that sees it: name the sample
            if fp8:  # e4m3fn has no inf; its NaNs are S.1111.111 (0x7f, 0xff)
                bad = ((t[key].view(torch.uint8) & 0x7F) == 0x7F).any(dim=1) | ~torch.isfinite(t[SCALES[key]]).all(1)
            else:
                bad = (~torch.isfinite(t[key])).any(dim=1)
            bad = bad.nonzero()
            if len(bad):
                sample = int(torch.searchsorted(t[OFFSETS], bad[0], right=True)[0]) - 1
                raise ValueError(f"{self.artifact.uri}/{name}: non-finite values (NaN/inf) in {key} of sample "
                                 f"{sample} of the shard (token {int(bad[0])})")
        return t

    def samples(self) -> Iterator[Sample]:
        for name in self.shards:
            yield from shard_samples(self.load_shard(name))

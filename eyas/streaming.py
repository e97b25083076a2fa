"""Reading a features artifact as a stream, through a bounded local cache.

A features artifact can be far larger than a trainer node's disk (32 KiB a token for an 8B target). So a reader
does not copy it first: each epoch it visits the shards in windows that fit half the cache, in an order shuffled by
(seed, epoch), and while the caller works through one window the next one is fetched in the background. The local
copy never holds more than the current window and the next, at most the cache's size (a cache that cannot hold two
of the shards is refused up front), and the caller keeps only the current window's tensors in memory.

Where the whole artifact fits half the cache, an epoch is one window in artifact order: every sample is shuffled with
every other, as a reader without a cap would, and the shards are fetched once for the whole run.
"""
from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from eyas.features import FeatureReader, Sample, shard_sample, shard_samples
from eyas.handoff import release
from eyas.windows import shard_windows

log = logging.getLogger(__name__)


class WindowCache:
    """Local copies of a run of windows: `enter(window, upcoming)` returns the window's local paths once fetched,
    deletes every other local shard but the upcoming window's, and starts fetching the upcoming window in a
    background thread. `fetch(name, path)` downloads (and verifies) one shard."""

    def __init__(self, fetch: Callable[[str, Path], None], cache_dir: Path):
        self.fetch, self.cache_dir = fetch, Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._prefetch: threading.Thread | None = None
        self._failed: BaseException | None = None
        self.fetched = 0  # shards downloaded (a shard fetched again in a later epoch counts again)

    def path(self, name: str) -> Path:
        return self.cache_dir / name

    def _get(self, names: list[str]) -> None:
        for name in names:
            local = self.path(name)
            if not local.exists():
                part = local.with_name(local.name + ".part")
                self.fetch(name, part)
                part.replace(local)  # whole or absent: a crash mid-fetch leaves no shard that looks complete
                self.fetched += 1

    def _background(self, names: list[str]) -> None:
        try:
            self._get(names)
        except BaseException as e:  # surfaced by the next enter(), which fetches again in the foreground
            self._failed = e

    def _join(self) -> None:
        if self._prefetch is not None:
            self._prefetch.join()
            self._prefetch = None
        if self._failed is not None:
            log.warning("prefetch failed (%s); fetching in the foreground", self._failed)
            self._failed = None

    def enter(self, window: list[str], upcoming: Sequence[str] = ()) -> dict[str, Path]:
        self._join()
        keep = set(window) | set(upcoming)
        for path in self.cache_dir.iterdir():  # what neither this window nor the next needs, before fetching more
            if path.name not in keep:
                path.unlink(missing_ok=True)
        self._get(window)
        if upcoming:
            self._prefetch = threading.Thread(target=self._background, args=(list(upcoming),),
                                              name="eyas-prefetch", daemon=True)
            self._prefetch.start()
        return {name: self.path(name) for name in window}

    def close(self) -> None:
        self._join()


def check_cache(sizes: dict[str, int], cache_bytes: int) -> None:
    """A window holds whole shards, so a cache is a bound only where the largest shard fits half of it (the window
    read and the next one fetched)."""
    name, largest = max(sizes.items(), key=lambda kv: kv[1], default=("", 0))
    if 2 * largest > cache_bytes:
        raise ValueError(f"cache_gb={cache_bytes / (1 << 30):g} cannot hold the features' shard {name} "
                         f"({largest / (1 << 20):.1f} MiB) twice over (the window read and the next one fetched): "
                         f"raise cache_gb to at least {2 * largest / (1 << 30):.3g}, or lower the extract job's "
                         "shard_mb and extract again")


class FeatureStream:
    """A features artifact read window by window through a WindowCache of `cache_bytes` (see the module doc).

    `scan_windows()` visits every sample once in artifact order (its index is the one eyas.features.is_validation splits
    on); `enter(seed, epoch, w)` loads window w of that epoch's shards (and starts fetching the next window) and
    `sample(i)` reads sample i of the loaded window. Which sample starts each shard comes from the scan, or from
    the artifact's index (`set_starts`). An artifact still being extracted (eyas.handoff) is read in the windows
    its extractor produces them in, each epoch's shards from that epoch's objects."""

    def __init__(self, reader: FeatureReader, cache_bytes: int):
        self.reader, self.cache_bytes = reader, cache_bytes
        self.sizes = reader.sizes
        check_cache(self.sizes, cache_bytes)
        # everything fits one window: read once, kept for the whole run
        self.whole = reader.stream is None and len(shard_windows(self.sizes, cache_bytes, None)) <= 1
        self._epoch_of: dict[str, int] = {}  # the epoch whose object a local shard copy is fetched from
        self.cache = WindowCache(self._fetch, reader.cache_dir)
        self._starts: list[int] = []  # first sample index of each shard, artifact order (after scan)
        self._start_of: dict[str, int] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self._window: list[str] | None = None
        self._released: set[tuple[int, int]] = set()

    def _fetch(self, name: str, path: Path) -> None:
        stream = self.reader.stream
        self.reader.fetch(stream.object_name(self._epoch_of[name], name) if stream else name, path)

    def _load(self, window: list[str], upcoming: list[str]) -> None:
        if window != self._window:
            self.cache.enter(window, upcoming)
            self._loaded = {name: self.reader.load_shard(name, self.cache.path(name)) for name in window}
            self._window = window

    def set_starts(self, shard_starts: list[int]) -> None:
        """Where each shard's samples start (the index's), in place of a scan."""
        self._starts = shard_starts[:len(self.reader.shards)]
        self._start_of = dict(zip(self.reader.shards, self._starts, strict=True))

    def scan_windows(self) -> Iterator[list[tuple[int, Sample]]]:
        """Every sample once, in artifact order (its index is the one eyas.features.is_validation splits on), a
        window at a time: the samples of one window are views into its loaded shards, valid until the next."""
        windows = shard_windows(self.sizes, self.cache_bytes, None)
        index, self._starts = 0, []
        for w, window in enumerate(windows):
            self._epoch_of.update(dict.fromkeys(window, 0))
            self._load(window, windows[w + 1] if w + 1 < len(windows) else [])
            samples = []
            for name in window:
                self._starts.append(index)
                self._start_of[name] = index
                for sample in shard_samples(self._loaded[name]):
                    samples.append((index, sample))
                    index += 1
            yield samples

    def windows(self, seed: int, epoch: int) -> list[list[str]]:
        """Epoch `epoch`'s windows: those the extractor produces, for an epoch it produces; else the cache's."""
        produced = self.reader.stream.windows(epoch) if self.reader.stream else None
        return produced if produced is not None else shard_windows(self.sizes, self.cache_bytes, seed, epoch)

    def epochs_available(self) -> int | None:
        """How many epochs can be read (None: any number): an extractor that recomputes produces only its own."""
        stream = self.reader.stream
        return stream.epochs if stream is not None and stream.policy == "recompute" else None

    @property
    def releases(self) -> bool:
        """The shards are deleted as training consumes them (a recompute hand-off)."""
        return self.epochs_available() is not None

    def release_before(self, seed: int, epoch: int, w: int) -> None:
        """(recompute) Delete every window before window w of `epoch` and say so to the extractor
        (eyas.handoff.release); called after a checkpoint past them is committed."""
        stream = self.reader.stream
        assert stream is not None and stream.policy == "recompute", "only a recompute hand-off deletes shards"
        for e in range(min(epoch + 1, stream.epochs)):
            for v in range(len(self.windows(seed, e)) if e < epoch else w):
                if (e, v) not in self._released:
                    release(self.reader.artifact, stream, e, v)
                    self._released.add((e, v))

    def shard_of(self, index: int) -> str:
        return self.reader.shards[bisect.bisect_right(self._starts, index) - 1]

    def enter(self, seed: int, epoch: int, w: int) -> None:
        """Load window w of `epoch`; fetch the next one (the next epoch's first, after the last) meanwhile."""
        windows = self.windows(seed, epoch)
        upcoming, upcoming_epoch = (windows[w + 1], epoch) if w + 1 < len(windows) else ([], epoch + 1)
        available = self.epochs_available()
        if not upcoming and (available is None or epoch + 1 < available):
            upcoming = self.windows(seed, epoch + 1)[0]
        # which epoch's object each shard not held locally comes from (one held is read again: the same samples)
        for name in windows[w]:
            if not self.cache.path(name).exists():
                self._epoch_of[name] = epoch
        for name in upcoming:
            if name not in windows[w]:
                self._epoch_of[name] = upcoming_epoch
        self._load(windows[w], upcoming)

    def sample(self, index: int) -> Sample:
        name = self.shard_of(index)
        tensors = self._loaded.get(name)
        if tensors is None:
            raise KeyError(f"sample {index} is in {name}, which is not in the loaded window")
        return shard_sample(tensors, index - self._start_of[name])

    def close(self) -> None:
        self.reader.closing.set()  # a prefetch waiting for a shard not yet extracted stops waiting
        self.cache.close()
        self._loaded, self._window = {}, None

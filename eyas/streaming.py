"""Reading a features artifact as a stream, through a bounded local cache.

A features artifact can be far larger than a trainer node's disk (32 KiB a token for an 8B target). So a reader
does not copy it first: each epoch it visits the shards in windows that fit half the cache, in an order shuffled by
(seed, epoch), and while the caller works through one window the next one is fetched in the background. The local
copy never holds more than the current window and the next, at most the cache's size (or one shard, where a single
shard is bigger than half of it), and the caller keeps only the current window's tensors in memory.

Where the whole artifact fits half the cache, an epoch is one window in artifact order: every sample is shuffled with
every other, as a reader without a cap would, and the shards are fetched once for the whole run.
"""
from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from eyas.features import FeatureReader, Sample, shard_sample, shard_samples
from eyas.manifest import fetch_verified

log = logging.getLogger(__name__)

DEFAULT_CACHE_GB = 64.0


def shard_windows(sizes: dict[str, int], cache_bytes: int, seed: int | None, epoch: int = 0) -> list[list[str]]:
    """Epoch `epoch`'s shards (name → bytes, in artifact order) in windows of at most half `cache_bytes` each
    (one shard at least): one window in artifact order when they all fit, else shuffled by (seed, epoch) — or in
    artifact order for seed None — and cut into consecutive windows. A pure function of its arguments."""
    names = list(sizes)
    half = cache_bytes // 2
    if sum(sizes.values()) <= half:
        return [names] if names else []
    order = names
    if seed is not None:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [names[i] for i in torch.randperm(len(names), generator=g).tolist()]
    windows: list[list[str]] = []
    used = half + 1  # start a window at the first shard
    for name in order:
        if used + sizes[name] > half:
            windows.append([])
            used = 0
        windows[-1].append(name)
        used += sizes[name]
    return windows


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

    def _path(self, name: str) -> Path:
        return self.cache_dir / name

    def _get(self, names: list[str]) -> None:
        for name in names:
            local = self._path(name)
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

    def enter(self, window: list[str], upcoming: list[str] = ()) -> dict[str, Path]:
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
        return {name: self._path(name) for name in window}

    def close(self) -> None:
        self._join()


class FeatureStream:
    """A features artifact read window by window through a WindowCache of `cache_bytes` (see the module doc).

    `scan()` visits every sample once in artifact order (its index is the one eyas.features.is_validation splits
    on) and learns where each shard's samples start; after it, `enter(windows, w)` loads window w's shards (and
    starts fetching window w + 1's) and `sample(i)` reads sample i of the loaded window."""

    def __init__(self, reader: FeatureReader, cache_bytes: int):
        self.reader, self.cache_bytes = reader, cache_bytes
        self.sizes = {name: reader.manifest.files[name].bytes for name in reader.shards}
        # everything fits one window: read once, kept for the whole run
        self.whole = len(shard_windows(self.sizes, cache_bytes, None)) <= 1
        self.cache = WindowCache(lambda name, path: fetch_verified(reader.artifact, reader.manifest, name, path),
                                 reader.cache_dir)
        self._starts: list[int] = []  # first sample index of each shard, artifact order (after scan)
        self._start_of: dict[str, int] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self._window: list[str] | None = None


    def _load(self, window: list[str], upcoming: list[str]) -> None:
        if window != self._window:
            self.cache.enter(window, upcoming)
            self._loaded = {name: self.reader.load_shard(name) for name in window}
            self._window = window

    def scan_windows(self) -> Iterator[list[tuple[int, Sample]]]:
        """Every sample once, in artifact order (its index is the one eyas.features.is_validation splits on), a
        window at a time: the samples of one window are views into its loaded shards, valid until the next."""
        windows = shard_windows(self.sizes, self.cache_bytes, None)
        index, self._starts = 0, []
        for w, window in enumerate(windows):
            self._load(window, windows[w + 1] if w + 1 < len(windows) else [])
            samples = []
            for name in window:
                self._starts.append(index)
                self._start_of[name] = index
                for sample in shard_samples(self._loaded[name]):
                    samples.append((index, sample))
                    index += 1
            yield samples

    def scan(self) -> Iterator[tuple[int, Sample]]:
        for window in self.scan_windows():
            yield from window

    def windows(self, seed: int, epoch: int) -> list[list[str]]:
        return shard_windows(self.sizes, self.cache_bytes, seed, epoch)

    def shard_of(self, index: int) -> str:
        return self.reader.shards[bisect.bisect_right(self._starts, index) - 1]

    def enter(self, windows: list[list[str]], w: int, following: list[str] = ()) -> None:
        """Load window w of `windows`; fetch the next one (or `following`, after the last) meanwhile."""
        self._load(windows[w], windows[w + 1] if w + 1 < len(windows) else list(following))

    def sample(self, index: int) -> Sample:
        name = self.shard_of(index)
        tensors = self._loaded.get(name)
        if tensors is None:
            raise KeyError(f"sample {index} is in {name}, which is not in the loaded window")
        return shard_sample(tensors, index - self._start_of[name])

    def close(self) -> None:
        self.cache.close()
        self._loaded, self._window = {}, None

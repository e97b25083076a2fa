"""Windows of shards: the runs of a features artifact a reader holds at once (eyas.streaming) or an extractor may
have stored ahead of its trainer (eyas.handoff). Pure functions of their arguments, so both sides of a hand-off
compute the same windows."""
from __future__ import annotations

import torch


def epoch_order(names: list[str], seed: int | None, epoch: int) -> list[str]:
    """The shards shuffled by (seed, epoch); artifact order for seed None."""
    if seed is None:
        return list(names)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return [names[i] for i in torch.randperm(len(names), generator=g).tolist()]


def cut_windows(order: list[str], sizes: dict[str, int], window_bytes: int) -> list[list[str]]:
    """`order` cut into consecutive windows of at most `window_bytes` (one shard at least: a reader's cache refuses
    a shard bigger than a window, eyas.streaming.check_cache)."""
    windows: list[list[str]] = []
    used = window_bytes + 1  # start a window at the first shard
    for name in order:
        if used + sizes[name] > window_bytes:
            windows.append([])
            used = 0
        windows[-1].append(name)
        used += sizes[name]
    return windows


def shard_windows(sizes: dict[str, int], cache_bytes: int, seed: int | None, epoch: int = 0) -> list[list[str]]:
    """Epoch `epoch`'s shards (name → bytes, in artifact order) in windows of at most half `cache_bytes` each
    (one shard at least): one window in artifact order when they all fit, else shuffled by (seed, epoch) — or in
    artifact order for seed None — and cut into consecutive windows."""
    names = list(sizes)
    half = cache_bytes // 2
    if sum(sizes.values()) <= half:
        return [names] if names else []
    return cut_windows(epoch_order(names, seed, epoch), sizes, half)

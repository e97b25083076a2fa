"""Capture that does not stall the GPU: a batch's captured states leave the device on a side stream into pinned
host buffers while the next batch's forward runs, and a background thread checks them, fills the shards and
uploads them.

    main thread    forward(b) → to_host(b) ─► forward(b+1) → to_host(b+1) ─► …
    side stream                 copy(b) ─────────────────────► copy(b+1)
    writer thread                          wait(b), check, shard, upload ─────► wait(b+1) …

On a CPU (or any device without CUDA streams) to_host is the states themselves, and only the writer thread
overlaps.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

Ready = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # waits for a batch's host copies and returns them


def to_host(aux: torch.Tensor, final: torch.Tensor) -> Ready:
    """aux [B, T, n_aux·H], final [B, T, H] (the target's dtype, on its device) → bf16 host copies, as shards store
    them. On CUDA the copy is queued on a side stream into pinned memory and this returns at once."""
    aux, final = aux.to(torch.bfloat16), final.to(torch.bfloat16)  # half the bytes to move when the target is fp32
    if aux.device.type != "cuda":
        host = aux.cpu(), final.cpu()
        return lambda: host
    device = aux.device
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # the states are complete before the copy starts
    with torch.cuda.stream(side):
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in (aux, final))
        done = torch.cuda.Event()
        done.record(side)
    for t in (aux, final):
        t.record_stream(side)  # the allocator must not hand their memory to the next forward before the copy ends

    def ready() -> tuple[torch.Tensor, torch.Tensor]:
        done.synchronize()
        return host
    return ready


_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class Background:
    """Runs submitted jobs in order on one thread, at most `depth` waiting (which bounds the pinned memory held).
    A job's exception is raised in the submitting thread: at its next submit(), or when the `with` block ends
    (which waits for every job). When the block itself raises, the jobs still waiting are dropped."""

    def __init__(self, depth: int = 2):
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="eyas-extract-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._error is None:  # after a failure the rest are dropped: their results would be discarded
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
                    self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        self._jobs.put(job)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, kind, value, _traceback) -> None:
        if kind is not None and self._error is None:
            self._error = value  # the caller failed: what waits is dropped, and the caller's exception propagates
        self._jobs.put(None)
        self._thread.join()
        if kind is None:
            self._raise()

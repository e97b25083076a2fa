"""Running a stage's work in a child process group (torchrun ranks, or the extractor's vLLM engine), relaying what
it prints.

Child processes print tagged lines (progress, files written); the parent turns them into job progress. A job
cancelled (or failing) in the parent stops every rank: the whole process group gets SIGTERM.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

CHECK_S = 0.5  # how often `check` runs while no line comes


def emit(line: str) -> None:
    """Print a tagged line for the parent in one write: ranks share torchrun's stdout pipe, and print() writes the
    text and its newline apart, so two ranks' lines could interleave (a pipe keeps one write of up to 4 KiB whole)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Lines:
    """A child process's stdout lines, read by a thread of their own, so that the parent can wait for the next one
    and still notice a cancel."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self._queue: queue.Queue[str | None] = queue.Queue()

        def read() -> None:  # the lines, then None at the end of the output
            assert proc.stdout is not None
            for line in proc.stdout:
                self._queue.put(line)
            self._queue.put(None)

        threading.Thread(target=read, name=name, daemon=True).start()

    def follow(self, check: Callable[[], None]) -> Iterator[str]:
        """Each line as it comes (its newline kept), `check()` between them and every CHECK_S seconds while none
        comes; ends with the output (and stays ended)."""
        while True:
            check()
            try:
                line = self._queue.get(timeout=CHECK_S)
            except queue.Empty:
                continue
            if line is None:
                self._queue.put(None)
                return
            yield line


def run_ranks(module: str, n: int, args: list[str], on_line: Callable[[str], bool], what: str,
              check: Callable[[], None] = lambda: None) -> None:
    """`torchrun --standalone` with `n` ranks of `python -m module *args`. Each stdout line goes to `on_line`
    (True: it was one of the tags; the others are echoed); `check()` runs between lines, and every CHECK_S seconds
    while none comes. An exception raised by either (a cancel) stops the process group and propagates; a non-zero
    exit raises RuntimeError naming `what`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", module,
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in Lines(proc, f"eyas-ranks-{module}").follow(check):
            if not on_line(line):
                sys.stdout.write(line)
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"torchrun with {n} {what} exited with {rc}")

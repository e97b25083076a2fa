"""Running a stage's work as torchrun ranks in a child process group, relaying what they print.

Rank processes print tagged lines (progress, files written); the parent turns them into job progress. A job
cancelled (or failing) in the parent stops every rank: the whole process group gets SIGTERM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable


def run_ranks(module: str, n: int, args: list[str], on_line: Callable[[str], bool], what: str) -> None:
    """`torchrun --standalone` with `n` ranks of `python -m module *args`. Each stdout line goes to `on_line`
    (True: it was one of the tags; the others are echoed). An exception raised by `on_line` (a cancel) stops the
    process group and propagates; a non-zero exit raises RuntimeError naming `what`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", module,
           *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not on_line(line):
                sys.stdout.write(line)
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"torchrun with {n} {what} exited with {rc}")

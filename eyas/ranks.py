"""Running a stage's work in a child process group (torchrun ranks, or another interpreter's process), relaying
what it prints.

Rank processes print tagged lines (progress, files written); the parent turns them into job progress. A job
cancelled (or failing) in the parent stops every rank: the whole process group gets SIGTERM.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

CHECK_S = 0.5  # how often `check` runs while no line comes


def run_ranks(module: str, n: int, args: list[str], on_line: Callable[[str], bool], what: str,
              check: Callable[[], None] = lambda: None) -> None:
    """`torchrun --standalone` with `n` ranks of `python -m module *args`, relayed (`run_relayed`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", module,
           *args]
    run_relayed(cmd, on_line, f"torchrun with {n} {what}", check)


def run_relayed(cmd: list[str], on_line: Callable[[str], bool], what: str, check: Callable[[], None] = lambda: None,
                env: dict[str, str] | None = None) -> None:
    """Run `cmd` in a process group of its own. Each stdout line goes to `on_line` (True: it was one of the tags;
    the others are echoed); `check()` runs between lines, and every CHECK_S seconds while none comes. An exception
    raised by either (a cancel) stops the process group and propagates; a non-zero exit raises RuntimeError naming
    `what`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:  # the process's lines, then None at the end of its output
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name=f"eyas-relay-{os.path.basename(cmd[0])}", daemon=True).start()
    try:
        while True:
            check()
            try:
                line = lines.get(timeout=CHECK_S)
            except queue.Empty:
                continue
            if line is None:
                break
            if not on_line(line):
                sys.stdout.write(line)
        rc = proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    if rc != 0:
        raise RuntimeError(f"{what} exited with {rc}")

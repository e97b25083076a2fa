"""The extract stage's vLLM backend, this side of it: a capture engine process (services.extractor.vllm_server) in
vLLM's own environment, started on a worker's first vLLM job and kept for the jobs after it (one engine per
process: a job for another target or layout replaces it). A job sends it the planned shards one at a time, as the
engine takes them, and relays what it reports: progress, and each shard once uploaded. The engine's own output
(vLLM's and its libraries' warnings) goes to a log file, not to the terminal: a job records the file's path, and an
engine that fails is reported with the file's last lines.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from eyas.manifest import FileEntry
from eyas.ranks import Lines
from services.extractor.plan import Batch
from services.extractor.shards import Uploaded
from services.extractor.vllm_protocol import DONE, NEXT, PROGRESS, READY, TAGS, UNSUPPORTED, UPLOADED

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


class EngineUnavailable(RuntimeError):
    """vLLM cannot serve this target here (no vLLM environment, or an architecture it does not know)."""


@dataclass(frozen=True)
class EngineConfig:
    python: str  # the interpreter of vLLM's environment
    target: str  # the target's HF directory
    aux_layers: tuple[int, ...]
    num_layers: int
    dtype: str
    tensor_parallel_size: int
    max_model_len: int


LOG_TAIL_LINES = 20  # of the engine's log, in the error of an engine that failed


class CaptureEngine:
    def __init__(self, config: EngineConfig, check: Callable[[], None], log_dir: Path):
        self.config = config
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"vllm-capture-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        self.log = self.log_path.open("a", encoding="utf-8", buffering=1)  # shared with the engine (its stderr)
        cmd = [config.python, "-m", "services.extractor.vllm_server", "--target", config.target,
               "--aux-layers", ",".join(map(str, config.aux_layers)), "--num-layers", str(config.num_layers),
               "--dtype", config.dtype, "--tensor-parallel-size", str(config.tensor_parallel_size),
               "--max-model-len", str(config.max_model_len)]
        # A checkout: vLLM's environment imports Eyas from it. An image installs Eyas into that environment instead,
        # and this process's site-packages (its torch) must not be on the engine's path: not its PYTHONPATH, not its
        # working directory (python -m puts that first).
        env, cwd = dict(os.environ), tempfile.gettempdir()
        if (REPO / "pyproject.toml").exists():
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            cwd = str(REPO)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=cwd, env=env, start_new_session=True)
        self.lines = Lines(self.proc, "eyas-vllm-engine")
        log.info("starting the vLLM capture engine for %s (tensor parallel %d); its log: %s", config.target,
                 config.tensor_parallel_size, self.log_path)
        try:
            for tag, payload in self._replies(check):
                if tag == READY:
                    return
                if tag == UNSUPPORTED:
                    raise EngineUnavailable(payload)
        except BaseException:
            self.close()
            raise

    def _replies(self, check: Callable[[], None]):
        """(tag, payload) of each tagged line the engine prints; its other lines go to its log file."""
        for line in self.lines.follow(check):
            tag = next((t for t in TAGS if line.startswith(t)), None)
            if tag is None:
                self.log.write(line)
                continue
            yield tag, line[len(tag):].rstrip("\n")
        code = self.proc.wait()
        self.log.flush()
        tail = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise RuntimeError(f"the vLLM capture engine exited with {code}; the last lines of its log "
                           f"({self.log_path}):\n" + "\n".join(tail))

    def _send(self, msg: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def extract(self, output_uri: str, dtype: str, shards, work: Iterable[tuple[int, str]],
                progress: Callable[[int], None], uploaded: Uploaded | None,
                check: Callable[[], None]) -> dict[str, FileEntry]:
        """Extract the shards `work` names (taken lazily, one ahead of the engine) into the artifact at
        `output_uri`, their states stored in `dtype` (the layout's); the entries of the shards uploaded."""
        items = iter(work)
        files: dict[str, FileEntry] = {}
        self._send({"output": output_uri, "dtype": dtype})

        def send_next() -> None:
            item = next(items, None)
            if item is None:
                self._send({"end": True})
                return
            index, obj = item
            batches: list[Batch] = shards[index]
            self._send({"index": index, "obj": obj,
                        "batches": [[[it.id, it.input_ids, it.loss_mask] for it in b] for b in batches]})

        send_next()
        for tag, payload in self._replies(check):
            if tag == NEXT:
                send_next()
            elif tag == PROGRESS:
                progress(int(payload))
            elif tag == UPLOADED:
                msg = json.loads(payload)
                files[msg["obj"]] = entry = FileEntry(**msg["entry"])
                if uploaded is not None:
                    uploaded(msg["obj"], entry)
            elif tag == DONE:
                return files
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log.close()


_engine: CaptureEngine | None = None
_lock = threading.Lock()


def release_engine() -> None:
    """Stop this process's capture engine, if one runs: a process that extracts no more (eyas run, past its
    extraction) gives its memory back (the bundled target's engine held 4 GB while the run trained and evaluated)."""
    global _engine
    with _lock:
        if _engine is not None:
            _engine.close()
            _engine = None


def extract_with_vllm(config: EngineConfig, output_uri: str, dtype: str, shards, work: Iterable[tuple[int, str]],
                      progress: Callable[[int], None], uploaded: Uploaded | None,
                      check: Callable[[], None], log_dir: Path) -> tuple[dict[str, FileEntry], Path]:
    """Run the job's shards on this process's engine (started, or restarted for another config, as needed, its log
    in `log_dir`), their states stored in `dtype`: the shards' entries, and the engine's log file. A job that fails or
    is cancelled mid-way stops
    the engine: the next job starts a fresh one."""
    global _engine
    with _lock:
        if _engine is not None and (_engine.config != config or _engine.proc.poll() is not None):
            _engine.close()
            _engine = None
        if _engine is None:
            _engine = CaptureEngine(config, check, log_dir)
        try:
            return _engine.extract(output_uri, dtype, shards, work, progress, uploaded, check), _engine.log_path
        except BaseException:
            _engine.close()
            _engine = None
            raise

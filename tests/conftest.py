"""Shared fixtures: real servers (Redis, SeaweedFS S3, vLLM on CPU) started once per session on free loopback
ports, per-test service settings, and helpers that start a stage's API (uvicorn) or Celery worker process."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from eyas.store import S3Store
from orchestration.settings import ServiceSettings
from tests.servers import S3_ACCESS, S3_SECRET, StartingVllm, _wait, free_port, redis_server, s3_server, vllm_starting

# Extract jobs run the target in transformers unless a test names the vLLM engine (engine: vllm): a capture engine
# takes ~30 s to start on 2 cores, and tests/test_vllm_capture.py proves it against this path
os.environ["EYAS_EXTRACT_ENGINE"] = "transformers"
# Evaluate jobs check their serving answer live only where a test asks for it (live_check auto): the checkout's
# .venv-vllm would otherwise have every evaluation start four vLLM servers
os.environ["EYAS_LIVE_CHECK"] = "off"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def plain_vllm() -> Iterator[StartingVllm]:
    """Real vLLM (CPU, fp32, eager) serving the bundled target as model "target"; one per session, launched by
    start_plain_vllm_early."""
    from eyas.target import bundled_target_dir

    with vllm_starting(bundled_target_dir()) as server:
        yield server


def selected_use(request: pytest.FixtureRequest, fixture: str) -> bool:
    """Whether any test this session runs (after -k/-m selection) uses `fixture`: a server launched ahead of its
    first user is launched only then."""
    return any(fixture in item.fixturenames for item in request.session.items)


@pytest.fixture(scope="session", autouse=True)
def start_plain_vllm_early(request: pytest.FixtureRequest) -> None:
    """Launch the session's plain vLLM before the first test where any selected test uses it: it starts (~20 s)
    while the tests before its first user run, instead of in that test's time."""
    if selected_use(request, "vllm_url"):
        request.getfixturevalue("plain_vllm")


@pytest.fixture(autouse=True)
def settle_started_vllm() -> None:
    """Before each test: torch gets its threads back from any launched vLLM server that has finished starting
    (tests.servers.StartingVllm)."""
    StartingVllm.settle()


@pytest.fixture(scope="session")
def vllm_url(plain_vllm: StartingVllm) -> str:
    """The session's plain vLLM's base URL, once it answers."""
    return plain_vllm.url()


BUNDLED_ANSWER_TOKENS = 48  # bundled_features' answers: the longest any of its users decodes


@dataclass(frozen=True)
class BundledFeatures:
    """The bundled target's greedy answers to tests.test_evaluator.PROMPTS and their features (default layout)."""

    prompts: Path  # the prompt file (messages JSONL)
    dataset: str  # the generate job's artifact URI
    features: str  # the extract job's artifact URI


@pytest.fixture(scope="session")
def bundled_features(tmp_path_factory) -> BundledFeatures:
    """One embedded generate → extract on the bundled target, shared by the tests that train a drafter on its own
    answers to a few prompts (each its own drafter: test_vllm_spec_decode, test_aux_layers, test_evaluator) instead
    of each generating and extracting the same again. A greedy answer cut at fewer tokens than BUNDLED_ANSWER_TOKENS
    is this one's prefix. (test_diagnose keeps its own 32-token data: on these 48-token answers its drafter's τ
    moved, and a reordered fc's restored τ missed the unbroken one's by 0.04, outside its 0.02.)"""
    from eyas.settings import Settings
    from orchestration.embedded import EmbeddedRunner
    from tests.test_evaluator import PROMPTS, write_prompts

    work = tmp_path_factory.mktemp("bundled-features")
    prompts = write_prompts(work / "prompts.jsonl", PROMPTS)
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[work]))
    jobs = emb.run_job("generate", {"prompts": str(prompts), "max_turns": 1, "then": ["extract"],
                                    "sampling": {"max_tokens": BUNDLED_ANSWER_TOKENS, "temperature": 0.0}})
    assert [j.state for j in jobs] == ["succeeded"] * 2, [(j.stage, j.error) for j in jobs]
    return BundledFeatures(prompts=prompts, dataset=jobs[0].artifacts["output"],
                           features=jobs[1].artifacts["output"])


@dataclass
class ServiceEnv:
    """Service-mode settings for one test: its own Redis database (flushed) and its own S3 bucket."""

    settings: ServiceSettings
    env: dict[str, str]  # the same settings as EYAS_* variables, for subprocesses
    workdir: Path


_buckets = itertools.count()


@pytest.fixture
def service_settings(redis_url: str, s3_endpoint: str, tmp_path: Path) -> Iterator[ServiceEnv]:
    """Jobs may read the test's own tmp_path and send requests to loopback servers (vLLM, proxies, fakes) on any
    port; tests of confinement narrow these (tests/test_hostile.py)."""
    redis.Redis.from_url(redis_url).flushdb()
    values = {
        "mode": "service", "redis_url": redis_url, "s3_endpoint": s3_endpoint, "s3_access_key": S3_ACCESS,
        "s3_secret_key": S3_SECRET, "s3_bucket": f"eyas-test-{os.getpid()}-{next(_buckets)}",
        "workdir": str(tmp_path / "work"), "input_roots": str(tmp_path), "allowed_endpoints": "http://127.0.0.1:*",
        # short, so a dead worker's task comes back within seconds in the tests
        "visibility_timeout_s": "3", "lease_sweep_s": "0.5",
        # the API tests queue generate jobs without an endpoint (no worker runs them); tests/test_quotas.py checks
        # that service mode refuses them by default
        "allow_in_process_generation": "true",
        "extract_engine": "transformers", "live_check": "off",
    }
    settings = ServiceSettings(**values)
    store = S3Store(settings)
    store.ensure_bucket()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EYAS_")}
    env.update({f"EYAS_{k.upper()}": v for k, v in values.items()})
    yield ServiceEnv(settings=settings, env=env, workdir=tmp_path)
    # the bucket goes with the test (a bucket holds a SeaweedFS volume); best effort: a test may have stopped S3
    try:
        store.delete_prefix("")
        store.client.remove_bucket(settings.s3_bucket)
    except Exception:  # noqa: BLE001 — cleanup must not turn a passing test red
        pass


@dataclass
class Proc:
    proc: subprocess.Popen
    log: Path
    url: str | None = None

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process and everything it started (a Celery worker and its pool processes)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group(signal.SIGKILL)  # pool processes left behind, if any
        if self.proc.poll() is None:
            self.proc.wait()


def _spawn(args: list[str], env: dict[str, str], name: str, logdir: Path) -> Proc:
    log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=logdir)[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "orchestration.cli", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(proc=proc, log=log)


@pytest.fixture
def api_process(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """start(stage, service_env) → a running `eyas api --stage S` on a free loopback port (Proc.url)."""
    started: list[Proc] = []

    def start(stage: str, service: ServiceEnv) -> Proc:
        port = free_port()
        p = _spawn(["api", "--stage", stage, "--host", "127.0.0.1", "--port", str(port)], service.env, f"api-{stage}",
                   tmp_path)
        started.append(p)
        p.url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{p.url}/healthz", timeout=2).status_code == 200, 90, f"{stage} API", p.proc, p.log)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """start(stage, service_env) → a running `eyas worker --stage S`, consuming once its log says ready."""
    started: list[Proc] = []

    def start(stage: str, service: ServiceEnv, concurrency: int = 1) -> Proc:
        p = _spawn(["worker", "--stage", stage, "--concurrency", str(concurrency)], service.env,
                   f"worker-{stage}", tmp_path)
        started.append(p)
        _wait(lambda: " ready." in p.tail(100_000), 90, f"{stage} worker", p.proc, p.log)
        return p

    yield start
    for p in started:
        p.stop()


def wait_for_job(get: Callable[[], dict], until: Callable[[dict], bool], timeout: float = 300,
                 what: str = "job") -> dict:
    """Poll a job (a dict from the API or a JobRecord dump) until `until(job)`; returns the job."""
    deadline = time.monotonic() + timeout
    job = get()
    while not until(job):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not get there in {timeout:.0f} s; last seen: {job}")
        time.sleep(0.2)
        job = get()
    return job

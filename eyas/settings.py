"""Typed settings, loaded once from the environment (prefix EYAS_) — see `get_settings()`. What only the orchestration
reads (the broker, leases, the APIs, the operator's quotas) extends these: orchestration.settings.ServiceSettings."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# the compose file's vLLM service: the one endpoint a service sends jobs' requests to unless configured otherwise
SERVICE_ENDPOINT = "http://vllm:8000"


def _checkout_vllm_python() -> Path | None:
    python = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return python if python.exists() else None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYAS_", env_file=".env", env_ignore_empty=True, extra="ignore")

    # embedded: local directory store, SQLite jobs, in-process tasks. service: S3 + Redis + Celery workers.
    mode: Literal["embedded", "service"] = "embedded"
    workdir: Path = Path("eyas-work")  # embedded store, job DB and caches live here
    cache_dir: Path = Field(default_factory=lambda: Path.home() / ".cache" / "eyas")  # converted bundled target

    # object store (service mode): any S3 server — MinIO in compose, SeaweedFS in tests
    s3_endpoint: str = "127.0.0.1:9000"
    s3_access_key: str = "eyas"
    s3_secret_key: SecretStr = SecretStr("eyas-secret")
    s3_secure: bool = False
    s3_bucket: str = "eyas"
    # how long one store operation keeps retrying while S3 is unreachable or answering 5xx (then the job fails)
    s3_retry_s: float = Field(120.0, ge=0)

    # A hand-off of features between an extract and a train job running together (eyas.handoff): how long either
    # side waits for the other (a shard, a consumed window) before it gives up.
    stream_stall_s: float = Field(3600.0, gt=0)

    # Generator: the most requests one worker process keeps in flight, whatever a job's concurrency (its global
    # maximum per endpoint) allows; more workers, more in flight, up to that maximum.
    worker_max_in_flight: int = Field(256, ge=1)

    # Where the extractor, trainer and evaluator compute (eyas.device): auto = this process's GPU if CUDA is
    # available, else the CPU; dtype auto = bfloat16 on a GPU, float32 on the CPU (a job spec's dtype wins).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    # The extract stage's vLLM capture engine (services.extractor.vllm_backend): the Python interpreter of vLLM's
    # environment (default: the checkout's .venv-vllm, where scripts/install-vllm.sh puts it, if present), and
    # what an extract spec's engine "auto" means here (default: vllm where that interpreter exists, else
    # transformers).
    vllm_python: Path | None = Field(default_factory=lambda: _checkout_vllm_python())
    extract_engine: Literal["vllm", "transformers"] | None = None

    # What a job may name (eyas.confine checks every spec field that names a file, an object or a URL).
    # Local directories whose files jobs may read (comma-separated); embedded mode adds the workdir, and the CLI
    # the files and directories its user names. Service default: none (inputs come from the bucket).
    input_roots: Annotated[list[Path], NoDecode] = []
    # Buckets jobs may read besides s3_bucket (comma-separated).
    allowed_buckets: Annotated[list[str], NoDecode] = []
    # Base URLs jobs may send requests to (comma-separated): "*" is any http(s) URL, a port "*" any port
    # (http://127.0.0.1:*). Default: embedded "*", service the compose vLLM service (SERVICE_ENDPOINT).
    allowed_endpoints: Annotated[list[str] | None, NoDecode] = None
    # Bearer key sent to those endpoints (a job spec never carries one: credentials in a URL are refused).
    endpoint_api_key: SecretStr | None = None
    # The evaluator's live check of its serving prediction: the command that starts vLLM's OpenAI server, to which
    # it appends --model, --served-model-name, --host 127.0.0.1, --port and --speculative-config (e.g.
    # "python -m vllm.entrypoints.openai.api_server --dtype float32"). It starts the servers a job did not name an
    # endpoint for, on loopback. Only the operator sets it: a job spec never names a program (eyas.confine).
    vllm_command: str | None = None
    # Whether the evaluator checks its serving answer live wherever it can start vLLM: auto = with vllm_command,
    # else with the OpenAI server of vllm_python's environment (services.evaluator.launch.serving_command); off =
    # only against the endpoints a job names (the tests' default: tests/conftest.py).
    live_check: Literal["auto", "off"] = "auto"

    @field_validator("input_roots", "allowed_buckets", "allowed_endpoints", mode="before")
    @classmethod
    def _comma_separated(cls, v):
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @property
    def store_root(self) -> Path:
        return self.workdir / "store"

    @property
    def job_buckets(self) -> tuple[str, ...]:
        """The buckets a job may name, and the only ones the service's S3 credentials are used for."""
        return tuple(dict.fromkeys([self.s3_bucket, *self.allowed_buckets]))


@lru_cache
def get_settings() -> Settings:
    return Settings()

"""The deployment's settings: eyas.settings.Settings (what the stages read) plus what only the orchestration reads
(the queue, leases, the APIs, the operator's quotas), from the same EYAS_ environment — see `get_service_settings()`.
The stages never see these fields: they live here so that eyas, the contract library, knows nothing of deployment."""
from __future__ import annotations

from functools import lru_cache

from pydantic import Field, SecretStr

from eyas.settings import Settings


class ServiceSettings(Settings):
    redis_url: str = "redis://127.0.0.1:6379/0"
    # How long a job of a dead worker (machine gone, whole worker SIGKILLed, pool process killed) waits before it
    # runs again, not a cap on task length: a running task holds its job's lease, renewed every third of this, and a
    # worker's sweep requeues a running job whose lease lapsed (orchestration.lease, orchestration.tasks).
    visibility_timeout_s: float = Field(60.0, gt=0)
    # How many runs a job gets whose worker dies under it (killed, out of memory, its machine gone): past that the
    # job fails, saying so, where it would otherwise be sent to the queue again and again.
    max_job_runs: int = Field(3, ge=1)
    # How often each worker sweeps for jobs whose lease lapsed (and the broker for its expired deliveries).
    lease_sweep_s: float = Field(2.0, gt=0)

    api_key: SecretStr | None = None  # bearer key for every API when set
    max_request_bytes: int = Field(1 << 20, ge=1024)  # API request bodies (job specs; data goes by URI)

    # Operator quotas (orchestration.quotas): a job over one is refused at submit with a 422 naming the field and
    # the cap, its `then` entries too; unset = no cap. Whether a generate job may name no endpoint (its target then
    # runs in the worker): unset = allowed in embedded mode, forbidden in service mode.
    allow_in_process_generation: bool | None = None
    # Prompts a job runs: generate's limit (a prompt file needs one) + synthesize; evaluate's two prompt counts.
    max_job_prompts: int | None = Field(None, ge=1)
    # Answer tokens a job asks for: answers (prompts × turns: a prompt file needs max_turns) × generate's
    # sampling.max_tokens; evaluate's prompts × max_new_tokens.
    max_job_tokens: int | None = Field(None, ge=1)
    max_job_epochs: float | None = Field(None, gt=0)  # train's epochs; extract's stream.epochs
    max_job_steps: int | None = Field(None, ge=1)  # train's steps (a train job without steps runs its epochs)
    # Wall time of one run of a job: past it the stage stops as at a cancel, and the job fails, saying so.
    max_job_minutes: float | None = Field(None, gt=0)

    @classmethod
    def of(cls, settings: Settings) -> ServiceSettings:
        """`settings` as the orchestration reads them: unchanged when they are ServiceSettings already, else the
        stages' settings as given, with the orchestration's own fields from the environment (EYAS_*, .env)."""
        if isinstance(settings, ServiceSettings):
            return settings
        return cls(**settings.model_dump())


@lru_cache
def get_service_settings() -> ServiceSettings:
    return ServiceSettings()

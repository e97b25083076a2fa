"""What a stage coordinates through (eyas.coordination), built for the deployment that runs it. The one place that
reads the mode for it:

  embedded                 this process's own limit per endpoint, and the run's work for this process alone
  service, any process     one limit per endpoint in Redis, shared by every process (orchestration.shared_limit)
  service, a stage worker  … and a run's work shared with the stage's other workers by chunk tasks
                           (orchestration.workshare), when the worker passes how to send them
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from eyas.coordination import LimitFactory, Share, local_limits, local_share
from eyas.settings import Settings
from orchestration.lease import Leases
from orchestration.settings import ServiceSettings
from orchestration.shared_limit import SharedLimit
from orchestration.workshare import SendChunk, share_by_tasks


@dataclass
class Coordination:
    limit: LimitFactory
    share: Callable[[str, str, int], Share]  # (stage, job_id, attempt) → how that run shares its work


def _alone(_stage: str, _job_id: str, _attempt: int) -> Share:
    return local_share


def coordination_for(settings: Settings, leases: Leases | None = None,
                     send_chunk: SendChunk | None = None) -> Coordination:
    settings = ServiceSettings.of(settings)
    if settings.mode != "service":
        return Coordination(limit=local_limits(settings.worker_max_in_flight), share=_alone)

    def shared_limit(key: str, maximum: int, initial: float) -> SharedLimit:
        return SharedLimit(settings.redis_url, key, maximum, initial=initial)

    if leases is None or send_chunk is None:
        return Coordination(limit=shared_limit, share=_alone)

    def share(stage: str, job_id: str, attempt: int) -> Share:
        return functools.partial(share_by_tasks, leases.client, leases, send_chunk, stage, job_id, attempt)

    return Coordination(limit=shared_limit, share=share)

"""What the job API answers: the job view with its links, and the 4xx bodies that name the field and the value."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Literal

from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel

from eyas.confine import masked
from orchestration.jobs import JobRecord, State


class Submitted(BaseModel):
    id: str
    status: State
    links: dict[str, str]


class JobView(JobRecord):
    links: dict[str, str]
    # a running job's holder: alive (its worker renews the job's lease) or orphaned (the lease lapsed: its worker
    # stopped, and a worker's sweep sends it to the queue again); null where not running or not known (embedded)
    liveness: Literal["alive", "orphaned"] | None = None


class Problem(BaseModel):
    field: str  # the field at fault, dotted ("sampling.max_tokens", "then[0].stage", "body")
    value: Any = None  # the value given
    message: str


class Problems(BaseModel):
    """4xx answers that name what is wrong."""
    detail: list[Problem]


class Message(BaseModel):
    detail: str


def links(job: JobRecord) -> dict[str, str]:
    """This service's routes for the job. Its pipeline's other jobs (`parent`, `next_job`) are other stages':
    their own services answer for them."""
    return {"self": f"/v1/jobs/{job.id}", "cancel": f"/v1/jobs/{job.id}/cancel"}


def view(job: JobRecord, alive: Callable[[str], bool] | None = None) -> JobView:
    """The API's view of a job; `alive(job_id)` says whether a running job's holder is alive, where known."""
    liveness = None
    if job.state == "running" and alive is not None:
        liveness = "alive" if alive(job.id) else "orphaned"
    return JobView(**job.model_dump(), links=links(job), liveness=liveness)


ECHO_CHARS = 256  # of the value a 4xx repeats back (the body it came in may be up to a MiB)


def _echoable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # 'nan', 'inf': JSON has no such numbers
    if isinstance(value, str):
        return masked(value)
    if isinstance(value, dict):
        return {k: _echoable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_echoable(v) for v in value]
    return value


def problem(field: str, value: Any, message: str) -> dict[str, Any]:
    """A 4xx entry: the field, the value given (JSON-safe, credentials in URIs masked, cut to ECHO_CHARS when
    long) and what is wrong."""
    try:
        value = _echoable(jsonable_encoder(value))
    except (TypeError, ValueError):
        value = masked(repr(value))
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > ECHO_CHARS:
        value = f"{text[:ECHO_CHARS]}… ({len(text)} characters)"
    return {"field": field, "value": value, "message": message}

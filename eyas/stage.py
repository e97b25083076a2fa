"""What a stage is: a typed job spec, and a plain `run(spec, ctx) -> StageResult` that reads its input artifact and
writes its output artifact through `ctx`.

Each stage (services/<stage>/core.py) exposes `Spec` (a StageSpec), `INPUT_FIELD` (the spec field that names the
input artifact), `run`, and optionally `assist` (a helper's share of a run's work). The orchestration builds the
context: where the output goes, the settings, how progress is reported (and cancellation noticed), and what the
stage may coordinate through (eyas.coordination: a concurrency limit per endpoint, a source of work items), each
built for the deployment. A stage never sees job records, queues or the deployment mode.

Cancellation: the orchestration sets `StageContext.stop` once the job's cancel is requested (it watches the job's
record while the stage runs); a stage calls `ctx.check()` (or passes it down) at the boundaries of its inner loops
(decoding steps, training steps, forward batches, prompts), which raises Cancelled there at no cost otherwise, so a
job stops within a step of the request whatever it is doing.
"""
from __future__ import annotations

import threading
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eyas.coordination import LimitFactory, Share, local_limits, local_share
from eyas.settings import Settings
from eyas.store import Artifact, ObjectStore


def _int_shape(annotation: Any) -> str | None:
    """'int' for an int field (Optional, Annotated), 'list' for a list of ints, else None."""
    if annotation is int:
        return "int"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _int_shape(args[0])
    if origin is list and args:
        return "list" if _int_shape(args[0]) == "int" else None
    if origin in (typing.Union, types.UnionType):
        shapes = {_int_shape(a) for a in args if a is not type(None)}
        return shapes.pop() if len(shapes) == 1 else None
    return None


def integral_floats(model: type[BaseModel], data: Any) -> Any:
    """JSON has one kind of number: 2.0 is the integer 2 (JSON schema says so too). Strict models refuse a float
    for an int field, so a spec's integral floats become ints first; true and "2" stay refused."""
    if not isinstance(data, dict):
        return data

    def whole(v: Any) -> Any:
        return int(v) if isinstance(v, float) and v.is_integer() else v

    out = dict(data)
    for name, value in data.items():
        field = model.model_fields.get(name)
        shape = _int_shape(field.annotation) if field is not None else None
        if shape == "int":
            out[name] = whole(value)
        elif shape == "list" and isinstance(value, list):
            out[name] = [whole(v) for v in value]
    return out


UNIX_TIME_MAX = 4_102_444_800.0  # 2100-01-01: the bound of a deadline field (a spec's `finish_by`, Unix seconds)


class StageSpec(BaseModel):
    """Base of every stage's job spec. `then` lists the stages to run after this one, each a stage name or
    {"stage": name, ...spec overrides}; the next stage's input is this stage's output artifact."""

    # strict: JSON true is not the number 1, "3" is not 3 (a spec says what it means or is refused); NaN and
    # Infinity are no number of any field
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    then: list[str | dict[str, Any]] = Field([], max_length=3, description=(
        "the stages to run after this one, in pipeline order: a stage name, or {\"stage\": name, ...its spec "
        "fields} (its input is this stage's output)"))

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: Any) -> Any:
        return integral_floats(cls, data)

    def hands_off_early(self) -> bool:
        """Whether the next stage of `then` may start on this job's output before the job ends (the output is
        readable while written): the stage calls StageContext.hand_off when it is, and the orchestration runs the
        next job beside this one."""
        return False


class Cancelled(RuntimeError):
    """Raised inside a stage by `StageContext.check` (and `progress`) once the job's cancellation was requested."""


# (done, total, unit, metrics) → True when the job's cancellation was requested
ProgressSink = Callable[[int, int, str, dict[str, Any]], bool]


@dataclass
class StageContext:
    job_id: str
    settings: Settings
    store: ObjectStore
    output: Artifact  # where this job's artifact goes (deterministic: {kind}/{job_id})
    report: ProgressSink = lambda done, total, unit, metrics: False
    attempt: int = 1  # the job's run number (a redelivered task runs it again)
    # limit(key, maximum, initial): the concurrency limit against `key` (an endpoint), this process's or shared
    limit: LimitFactory = field(default_factory=lambda: local_limits(256))
    # share(ids, helpers, min_chunk, ordered): the run's source of work items, shared with up to `helpers` other workers
    # where the deployment has them (their part runs the stage's `assist`)
    share: Share = local_share
    # hand_off(): this job's output can be read while it is written (a features stream was announced): the next
    # stage of its `then` may start now (where a spec hands off early: StageSpec.hands_off_early)
    hand_off: Callable[[], Any] = lambda: None
    metrics: dict[str, Any] = field(default_factory=dict)
    # set once the job's cancellation was requested (by the orchestration, or by a report that said so)
    stop: threading.Event = field(default_factory=threading.Event)
    _last_progress: float = 0.0

    def check(self) -> None:
        """Raise Cancelled if the job's cancellation was requested: cheap (no store round trip), for the stage's
        inner loops to call between steps, or to pass down to the code that runs them."""
        if self.stop.is_set():
            raise Cancelled(f"job {self.job_id} was cancelled")

    def progress(self, done: int, total: int, unit: str = "", force: bool = False) -> None:
        """Report progress (at most once a second) and raise Cancelled if the job's cancellation was requested
        (at once, whenever the request is already known)."""
        self.check()
        now = time.monotonic()
        if force or done >= total or now - self._last_progress > 1.0:
            self._last_progress = now
            if self.report(done, total, unit, dict(self.metrics)):
                self.stop.set()
                self.check()


@dataclass
class StageResult:
    output_uri: str
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)

"""What a stage is, to the platform: a typed spec, an output kind, and a plain `run(spec, ctx)` function.

Stages live in services/<stage>/core.py and register here by name; routes, Celery tasks, the CLI and `eyas run`
all call the same `run` through `eyas.pipeline.execute`.
"""
from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from eyas.jobs import JobStore, Progress, update
from eyas.settings import Settings
from eyas.store import Artifact, ObjectStore

log = logging.getLogger(__name__)

STAGE_ORDER = ("generate", "extract", "train", "evaluate")
# stage → (module with SPEC, OUTPUT_KIND and run(spec, ctx), the artifact folder it writes)
_MODULES = {
    "generate": "services.generator.core",
    "extract": "services.extractor.core",
    "train": "services.trainer.core",
    "evaluate": "services.evaluator.core",
}
ARTIFACT_DIRS = {"generate": "datasets", "extract": "features", "train": "drafters", "evaluate": "reports"}


class StageSpec(BaseModel):
    """Base of every stage's job spec. `then` lists the stages to run after this one, each a stage name or
    {"stage": name, ...spec overrides}; the next stage's input is this stage's output artifact."""

    model_config = ConfigDict(extra="forbid")
    then: list[str | dict[str, Any]] = []


class Cancelled(RuntimeError):
    pass


@dataclass
class StageContext:
    job_id: str
    settings: Settings
    store: ObjectStore
    jobs: JobStore
    output: Artifact  # where this job's artifact goes (deterministic: {kind}/{job_id})
    attempt: int = 1  # the job's run number (a redelivered task runs it again)
    # service mode: recruit(n) asks n more workers of this stage to help with this run (the stage's `assist`)
    recruit: Callable[[int], None] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    _last_progress: float = 0.0

    def progress(self, done: int, total: int, unit: str = "", force: bool = False) -> None:
        """Record progress on the job (throttled to one write a second) and raise if a cancel was requested."""
        now = time.monotonic()
        if force or done >= total or now - self._last_progress > 1.0:
            self._last_progress = now
            job = update(self.jobs, self.job_id, progress=Progress(done=done, total=total, unit=unit),
                         metrics=dict(self.metrics))
            if job.cancel_requested:
                raise Cancelled(f"job {self.job_id} was cancelled")


@dataclass
class StageResult:
    output_uri: str
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)


@dataclass
class Stage:
    name: str
    spec_cls: type[StageSpec]
    run: Callable[[StageSpec, StageContext], StageResult]
    input_field: str
    # a helper's part of a running job (generator only): joins the work the job's own run shares
    assist: Callable[[StageSpec, StageContext], None] | None = None


def get_stage(name: str) -> Stage:
    if name not in _MODULES:
        raise KeyError(f"unknown stage {name!r}; stages are {list(_MODULES)}")
    mod = importlib.import_module(_MODULES[name])
    return Stage(name=name, spec_cls=mod.Spec, run=mod.run, input_field=mod.INPUT_FIELD,
                 assist=getattr(mod, "assist", None))

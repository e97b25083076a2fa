"""The stage registry: stage names in pipeline order, the module that implements each, and the artifact folder it
writes. Routes, Celery tasks, the CLI and `eyas run` find a stage here and run it through
`orchestration.execution.execute`.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, create_model
from pydantic.json_schema import SkipJsonSchema

from eyas.coordination import Work
from eyas.stage import StageContext, StageResult, StageSpec

STAGE_ORDER = ("generate", "extract", "train", "evaluate")  # the pipeline, in the order `then` chains it
STAGES = (*STAGE_ORDER, "diagnose")  # every stage with a queue, an API and a command (diagnose: outside the pipeline)
# stage → module with Spec, INPUT_FIELD and run(spec, ctx) (and optionally assist and ARTIFACT_MODELS)
_MODULES = {
    "generate": "services.generator.core",
    "extract": "services.extractor.core",
    "train": "services.trainer.core",
    "evaluate": "services.evaluator.core",
    "diagnose": "services.evaluator.diagnose",
}
# stage → the module with its Spec alone, which imports no torch: the CLI builds a command's flags from it
_SPEC_MODULES = {
    "generate": "services.generator.spec",
    "extract": "services.extractor.spec",
    "train": "services.trainer.spec",
    "evaluate": "services.evaluator.spec",
    "diagnose": "services.evaluator.diagnose_spec",
}
ARTIFACT_DIRS = {"generate": "datasets", "extract": "features", "train": "drafters", "evaluate": "reports",
                 "diagnose": "diagnoses"}


def stages_after(stage: str) -> tuple[str, ...]:
    """The pipeline stages a job of `stage` may chain in `then`, in order (none after evaluate or diagnose)."""
    return STAGE_ORDER[STAGE_ORDER.index(stage) + 1:] if stage in STAGE_ORDER else ()


@dataclass
class Stage:
    name: str
    spec_cls: type[StageSpec]
    run: Callable[[StageSpec, StageContext], StageResult]
    input_field: str
    # a helper's part of a running job (generator only): works a share of what the job's own run shares
    assist: Callable[[StageSpec, StageContext, Work], None] | None = None
    # the JSON documents among its artifacts (StageResult.artifacts name → model), which its API schema documents
    artifact_models: dict[str, type[BaseModel]] = field(default_factory=dict)


def get_stage(name: str) -> Stage:
    if name not in _MODULES:
        raise KeyError(f"unknown stage {name!r}; stages are {list(_MODULES)}")
    mod = importlib.import_module(_MODULES[name])
    return Stage(name=name, spec_cls=mod.Spec, run=mod.run, input_field=mod.INPUT_FIELD,
                 assist=getattr(mod, "assist", None), artifact_models=getattr(mod, "ARTIFACT_MODELS", {}))


def stage_spec(name: str) -> type[StageSpec]:
    """Stage `name`'s job spec, without importing the stage (torch, transformers): get_stage(name).spec_cls."""
    return importlib.import_module(_SPEC_MODULES[name]).Spec


def stage_doc(name: str) -> str:
    """The docstring of the module that runs stage `name`, read from its source rather than by importing it."""
    source = Path(importlib.util.find_spec(_MODULES[name]).origin).read_text(encoding="utf-8")
    return ast.get_docstring(ast.parse(source)) or ""


def _not_here(why: str) -> Any:
    """A field a `then` entry may not set: hidden from its schema, refused (naming why) when given."""

    def refuse(_value: Any) -> None:
        raise ValueError(why)

    return (SkipJsonSchema[Annotated[None, BeforeValidator(refuse)]], None)


@lru_cache
def step_model(name: str) -> type[StageSpec]:
    """What a `then` entry for stage `name` may say: its stage, and any field of its spec but the input (the
    output of the stage before) and `then` (the pipeline's own list goes on). A subclass of the stage's spec, so
    every rule of the spec holds for the entry too."""
    stage = get_stage(name)
    return create_model(
        f"{name.capitalize()}Step", __base__=stage.spec_cls,
        stage=(Literal[name], Field(description="the stage this entry runs")),
        **{stage.input_field: _not_here("set by the pipeline: the output of the stage before"),
           "then": _not_here("the pipeline's own `then` lists what follows")})

"""The API schema says what a submission must be, beyond the spec class FastAPI reads:

  - each field that names a file, object or URL (eyas.confine.Names) carries the pattern this service's settings
    allow (`Policy.pattern`, the expression the check itself applies);
  - `then` is the stages after this one, in pipeline order, each a name or its `then` entry model
    (orchestration.registry.step_model: its spec without the input);
  - the operator's quotas (orchestration.quotas) a field's own value keeps to are its maximum, there and in the
    `then` entries, and `endpoint` is required where in-process generation is off. A cap over a sum or product of
    fields (prompts of two sources, tokens), or one needing a field the spec leaves unset (a prompt file's limit),
    is submit's alone: the 422 names it.
It also says what a job's JSON artifacts hold (the evaluator's report: Stage.artifact_models): each model's schema
under components, named by the job view's `artifacts` entry that points at the document.
So a request the schema calls valid is one the service takes, and one it calls invalid is refused.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from eyas.confine import SCHEMA_KEY, Names, Policy
from orchestration.quotas import FIELD_CAPS, in_process_generation_allowed
from orchestration.registry import get_stage, stages_after, step_model
from orchestration.settings import ServiceSettings


def _patterns(node: Any, policy: Policy) -> None:
    if isinstance(node, dict):
        marker = node.pop(SCHEMA_KEY, None)
        if marker is not None:
            node["pattern"] = policy.pattern(Names(marker["what"], marker["s3"], tuple(marker["exact"])))
        for value in node.values():
            _patterns(value, policy)
    elif isinstance(node, list):
        for value in node:
            _patterns(value, policy)


def _then(schema: dict[str, Any], stage: str) -> None:
    components = schema["components"]["schemas"]
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    spec = components[body["$ref"].rsplit("/", 1)[1]]
    entries = []
    for name in stages_after(stage):
        model = step_model(name)
        entry = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(entry.pop("$defs", {}))
        components[model.__name__] = entry
        entries.append({"anyOf": [{"const": name}, {"$ref": f"#/components/schemas/{model.__name__}"}]})
    then = spec["properties"]["then"]
    then.pop("items", None)
    then.update({"type": "array", "maxItems": len(entries)})
    if entries:  # (an empty prefixItems is not a schema)
        then.update({"prefixItems": entries, "items": False})


def _maximum(model: dict[str, Any], path: list[str], cap: float, components: dict[str, Any]) -> None:
    """Lower the maximum of field `path` (through the models it refers to) of `model` to `cap`."""
    prop = model.get("properties", {}).get(path[0])
    if prop is None:
        return
    for node in [prop, *prop.get("anyOf", [])]:
        if len(path) > 1 and "$ref" in node:
            _maximum(components[node["$ref"].rsplit("/", 1)[1]], path[1:], cap, components)
        elif len(path) == 1 and node.get("type") in ("integer", "number"):
            node["maximum"] = min(node.get("maximum", cap), cap)


def _quotas(schema: dict[str, Any], stage: str, settings: ServiceSettings) -> None:
    components = schema["components"]["schemas"]
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    models = {stage: components[body["$ref"].rsplit("/", 1)[1]]}
    models |= {name: components[step_model(name).__name__] for name in stages_after(stage)}
    for name, model in models.items():
        for field, setting in FIELD_CAPS.get(name, ()):
            if (cap := getattr(settings, setting)) is not None:
                _maximum(model, field.split("."), cap, components)
    if stage == "generate" and not in_process_generation_allowed(settings):
        spec = models[stage]
        endpoint = spec["properties"]["endpoint"]
        endpoint.pop("default", None)
        endpoint.update(next(b for b in endpoint.pop("anyOf") if b.get("type") != "null"))
        spec["required"] = [*spec.get("required", []), "endpoint"]


def _artifacts(schema: dict[str, Any], stage: str) -> None:
    """The job view's `artifacts` (name → URI) names, for each JSON artifact of the stage, the model of the document
    at that URI; the models' schemas go under components (a name another schema holds is an error)."""
    models = get_stage(stage).artifact_models
    if not models:
        return
    components = schema["components"]["schemas"]
    documents = {}
    for name, model in models.items():
        entry = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for key, value in {**entry.pop("$defs", {}), model.__name__: entry}.items():
            if components.setdefault(key, value) != value:
                raise RuntimeError(f"the {stage} API schema has two schemas named {key}")
        documents[name] = {"type": "string",
                           "description": f"URI of a JSON document: #/components/schemas/{model.__name__}"}
    components["JobView"]["properties"]["artifacts"]["properties"] = documents


def documented(app: FastAPI, stage: str, settings: ServiceSettings) -> Callable[[], dict[str, Any]]:
    """A replacement for `app.openapi`: FastAPI's schema, completed as above (built once)."""
    plain = app.openapi
    policy = Policy.of(settings)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain()
            _then(schema, stage)
            _quotas(schema, stage, settings)
            _artifacts(schema, stage)
            _patterns(schema, policy)
        return app.openapi_schema

    return openapi

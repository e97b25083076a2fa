"""Wiring check: from a drafter's export configs and the target, derive exactly which tensors each engine will
concatenate and feed the drafter, and refuse with a named reason when that is not what it was trained on.

What is checked (docs/eagle3.md §3, §7):
  target     the target to evaluate/serve with has the layout's config hash, tokenizer hash, depth and width
  recorded   a config's `eyas_layout` (written by the exporter) equals the drafter's layout
  width      fc's input width equals (number of concatenated states) × hidden size
  capture    vLLM (eagle/ and speculators/ configs) and SGLang (eagle/ config) capture the trained layers, in the
             trained order (eyas.layout.check_serving: wrong layers, wrong order, off-by-one, embedding)
  residual   the engine's view has norm_before_residual false (vLLM defaults it to TRUE for speculators configs)
  precision  the target's dtype and quantization against the ones the states were captured at (a warning only)
`recorded_contradictions` reads one export's files alone (what it records against what an engine reads from it), for
exports that come without the drafter's manifest (eyas diagnose).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eyas.layout import (
    Layout,
    LayoutMismatch,
    check_layout,
    check_serving,
    default_aux_layers,
    describe,
    mismatch_kind,
    vllm_capture_layers,
    vllm_view,
)
from eyas.methods import EXPORT_DIRS, SERVED
from eyas.target import Target

ENGINES = ("vllm", "sglang")


class WiringMismatch(LayoutMismatch):
    """The drafter would be served with other tensors than it was trained on."""


@dataclass(frozen=True)
class Contradiction:
    """What an export's files say against each other, with its fix; `trained`: the aux layers (out(i)) the recorded
    layout says the drafter was trained on, where an engine reads others (None: no layer ids to change)."""
    finding: str
    trained: tuple[int, ...] | None = None


def recorded_layout(config: dict[str, Any]) -> Layout | None:
    """The layout an export's config.json records (Eyas's `eyas_layout`; a speculators config may nest it)."""
    recorded = config.get("eyas_layout") or (config.get("transformer_layer_config") or {}).get("eyas_layout")
    return Layout.from_dict(recorded) if recorded is not None else None


def _ids_contradiction(layout: Layout, engine: str, where: str, served: list[int], ids: Any) -> Contradiction | None:
    """`engine` reads `served` (out(i)) from the config's ids at `where` ("": top level), `ids` as written there."""
    trained = list(layout.aux_layers)
    if served == trained:
        return None
    written = (f"{where}eagle_aux_hidden_state_layer_ids {ids}" if ids is not None
               else f"{where}eagle_aux_hidden_state_layer_ids unset")
    fix = layout.vllm_ids if engine == "vLLM" else layout.sglang_ids
    return Contradiction(
        f"config.json has {engine} read {', '.join(describe(served))} ({written}) while its eyas_layout.aux_layers "
        f"says {trained}, the layers the drafter was trained on ({mismatch_kind(trained, served)}); fix: set "
        f"{where}\"eagle_aux_hidden_state_layer_ids\": {fix}", layout.aux_layers)


def recorded_contradictions(config: dict[str, Any], num_layers: int,
                            architectures: list[str]) -> list[Contradiction]:
    """An export's config.json against itself and its target (`num_layers` layers, `architectures`), from the files
    alone: the speculators config's verifier against the target's architecture, and the layout it records
    (eyas_layout) against the layer ids vLLM and SGLang will read from the same config."""
    found = []
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("architectures") and architectures and list(verifier["architectures"]) != list(architectures):
        found.append(Contradiction(
            f"the speculators config's verifier is a {verifier['architectures']} ({verifier.get('name_or_path')}) "
            f"but the target is a {architectures}: the drafter was trained for another target; fix: diagnose and "
            "serve it with its verifier"))
    layout = recorded_layout(config)
    if layout is None:
        return found
    if layout.num_layers != num_layers:
        return [*found, Contradiction(
            f"its eyas_layout records a target of {layout.num_layers} layers, the target has {num_layers}: the "
            "drafter was trained for another target; fix: diagnose and serve it with that target")]
    top = config.get("eagle_aux_hidden_state_layer_ids")
    found.append(_ids_contradiction(layout, "vLLM", "", vllm_capture_layers(config, num_layers), top))
    if "speculators_model_type" not in config:  # SGLang loads the EAGLE layout only
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        served = sorted(int(i) for i in ids) if ids is not None else list(default_aux_layers(num_layers))
        found.append(_ids_contradiction(layout, "SGLang", "eagle_config's ", served, ids))
    return [c for c in found if c is not None]


def check_target(layout: Layout, target: Target) -> None:
    """The target the drafter is evaluated (and served) with must be the one its layout was recorded from."""
    actual = dataclasses.replace(layout, target_config_hash=target.config_hash, tokenizer_hash=target.tokenizer_hash,
                                 num_layers=target.num_layers, hidden_size=target.hidden_size,
                                 vocab_size=target.config.vocab_size)
    try:
        check_layout(layout, actual, what=f"target {target.name}")
    except LayoutMismatch as e:
        raise WiringMismatch(f"drafter was trained for another target: {e}") from None


def _fc_width(export: Path) -> int:
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return int(f.get_slice("fc.weight").get_shape()[1])


def check_export_wiring(layout: Layout, export: Path, engine: str) -> list[int]:
    """Check one export directory (config.json + model.safetensors) as `engine` loads it; returns the served
    layers (physical out(i), EMBED = -1) or raises WiringMismatch naming the export, the engine and the reason."""
    config: dict[str, Any] = json.loads((export / "config.json").read_text())
    where = f"{export.name}/config.json on {engine}"
    try:
        recorded = recorded_layout(config)
        if recorded is not None:
            check_layout(layout, recorded, what=f"{export.name}/config.json eyas_layout")
        served = check_serving(layout, config, engine)
        width = _fc_width(export)
        if width != len(served) * layout.hidden_size:
            raise LayoutMismatch(f"fc takes {width} inputs but {engine} feeds {len(served)} × {layout.hidden_size}")
        view = vllm_view(config) if engine == "vllm" else config
        if view.get("norm_before_residual", False):
            raise LayoutMismatch(f"{engine} reads norm_before_residual=true; the drafter was trained without it")
    except LayoutMismatch as e:
        raise WiringMismatch(f"{where}: {e}") from None
    return served


def precision_check(layout: Layout, target: Target) -> dict[str, Any]:
    """The precision the drafter's states were captured at against the one `target` runs at: the same network in
    another dtype or quantization feeds the drafter other states (a drafter trained on bf16 states accepts less
    on an FP8 or INT4 build), so a difference is a warning with both named, not a refusal."""
    here = target.precision
    out: dict[str, Any] = {"trained": layout.precision or None, "target": here}
    if layout.precision and layout.precision != here:
        out["warning"] = (f"the drafter was trained on states captured at {layout.precision}; this target runs at "
                          f"{here}: its acceptance here may differ from the served one — train on states "
                          f"captured from the target as it is served (eyas extract --engine vllm on that build)")
    return out


def check_wiring(layout: Layout, drafter_dir: Path, target: Target | None = None,
                 engines: tuple[str, ...] = ENGINES) -> dict[str, Any]:
    """Every export × engine that loads it; raises WiringMismatch on the first that would be mis-wired. With a
    target: it must be the trained one, and its precision is compared with the trained one (a warning)."""
    precision = None
    if target is not None:
        check_target(layout, target)
        precision = precision_check(layout, target)
    served: dict[str, Any] = {}
    for engine, name in SERVED:  # every export each engine loads, of any method (SGLang: the EAGLE layout only)
        if engine in engines and (drafter_dir / name / "config.json").is_file():
            served[f"{engine}:{name}"] = describe(check_export_wiring(layout, drafter_dir / name, engine))
    if not served:
        raise WiringMismatch(f"{drafter_dir}: no {', '.join(f'{d}/' for d in EXPORT_DIRS)} export to check")
    return {"trained": describe(list(layout.aux_layers)), "served": served, "ok": True,
            **({"precision": precision} if precision else {})}

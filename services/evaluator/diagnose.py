"""Diagnose stage (`eyas diagnose`): why a drafter that trained well accepts little when served.

Given an EAGLE-3 drafter (an Eyas drafter artifact, or any export directory: EAGLE/SpecForge's config.json +
model.safetensors, or a speculators checkpoint), its target and optionally the endpoint serving it, τ is measured on
the same prompts three ways:
  in-process  the drafter wired as its config says (aux layer ids, EAGLE 3.1 norm flags, d2t), by replay of the
              target's greedy output (services.evaluator.chains: exactly what speculative decoding counts)
  served      the endpoint's own spec-decode counters over the same token-id prompts (`endpoint`, or a vLLM started
              with the drafter from Settings.vllm_command with `serve`)
  expected    from per-position teacher-forced accuracy: the training's promise (`expected_accuracy`, else an Eyas
              drafter's last validation)
Before any τ, what the export's files record (Eyas's eyas_layout, the speculators config's verifier) is checked
against the layer ids the engines will read from the same config and against the target: a contradiction is the
verdict, with its fix (services.evaluator.wiring.recorded_contradictions).
Then the known mis-wirings are tried in-process, one at a time (`variants`: aux ids shifted ±1, the aux blocks in
another order, d2t holding target ids instead of offsets or missing, each norm flag ignored, the chat template's
thinking mode toggled, zero states), and the verdict names the one that brings τ to what the drafter can do, or
the one that explains what the engine measured, with the config change or serving flag that fixes it; where every
variant that differs moves τ by less than the noise, it says it cannot tell at this τ, with the numbers. The input is
never changed; `write_fixed` writes a fixed export into this job's artifact (fixed/; `--out DIR` puts the artifact
in DIR).

Writes diagnoses/{id}/: diagnosis.json (the figures, every variant tried, the verdict), diagnosis.html, manifest.
"""
from __future__ import annotations

import contextlib
import html
import itertools
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from eyas.device import placement
from eyas.drafter import NORM_FLAGS, Drafter
from eyas.exports import (
    CONFIG,
    EAGLE_DIR,
    HISTORY,
    WEIGHTS,
    drafter_name,
    speculators_name,
)
from eyas.layout import default_aux_layers
from eyas.manifest import ArtifactWriter, Manifest, fetch_verified, read_manifest
from eyas.methods import DraftingMethod, load_drafter, method_of, method_of_export
from eyas.stage import StageContext, StageResult
from eyas.store import open_artifact
from eyas.target import Target, load_target, resolve_target
from services.evaluator import launch
from services.evaluator.chains import chain_acceptance, drafter_runs, target_pass
from services.evaluator.diagnose_spec import K_MAX, Spec
from services.evaluator.live import timed_completions
from services.evaluator.report import expected_acceptance_length
from services.evaluator.specdec import PromptIds, eval_prompts, greedy, stop_ids
from services.evaluator.wiring import WiringMismatch, check_target, recorded_contradictions, recorded_layout

log = logging.getLogger(__name__)
INPUT_FIELD = "drafter"
@dataclass(frozen=True)
class Variant:
    """One way of feeding and reading the drafter. The config's own is `as configured`; the others each change one
    thing the known mis-wirings change."""
    name: str
    cause: str  # what it means when this variant, and not the configured one, gives the drafter's τ
    fix: str  # the config change or serving flag that makes serving do what this variant does
    aux_layers: tuple[int, ...]  # eyas.layout numbering (out(i)), ascending: what the engine captures
    order: tuple[int, ...] = ()  # the aux blocks as fc receives them (a permutation; () = as captured)
    d2t: str = "given"  # given | offsets (the stored d2t holds target ids: subtract the index) | identity
    ignore_norms: tuple[str, ...] = ()  # EAGLE 3.1 flags the engine would not read
    template_kwargs: dict[str, Any] | None = None  # None: the traffic's
    zero_states: bool = False
    # what only a mis-feeding engine does (a norm skipped, no d2t, zero states): it may explain a served τ below the
    # configured one, never stand in for a better export (a weakly trained drafter may draft better without a norm)
    engine_fault: bool = False
    recorded: bool = False  # its aux layers are those the export's eyas_layout records, where the config reads others


@dataclass
class Exported:
    """The drafter as its export says: the directory, config.json, weights, and what it was trained with where an
    Eyas artifact records it."""
    path: Path
    config: dict[str, Any]
    num_layers: int
    aux_layers: tuple[int, ...]  # eyas.layout numbering, from the config's vLLM ids (id i = out(i-1))
    trained_kwargs: dict[str, Any] | None = None
    accuracy: list[float] | None = None
    static: list[str] = field(default_factory=list)  # mis-wirings visible in the files themselves
    recorded_aux: tuple[int, ...] | None = None  # what eyas_layout records, where an engine reads others from config


def _config_aux(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The aux layers (out(i)) an engine reads from the config: vLLM's top-level input-to ids (speculators: the
    same key), else the engines' default."""
    flat = config.get("transformer_layer_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or flat.get("eagle_aux_hidden_state_layer_ids")
    return tuple(i - 1 for i in ids) if ids else default_aux_layers(num_layers)


def _check_diagnosable(method: DraftingMethod, drafter: str) -> None:
    """Diagnose tries EAGLE-3's wirings on an eagle/ export: a method that writes none is refused."""
    if EAGLE_DIR not in method.export_dirs:
        raise ValueError(f"drafter {drafter} is a {method.title} drafter: diagnose tries EAGLE-3's wirings (aux "
                         "layers, order, vocabulary map, norms) on an eagle/ export, which it has none of; evaluate "
                         "it instead (its wiring check covers its target layers)")


def _fetch(spec: Spec, ctx: StageContext, local: Path, num_layers: int) -> Exported:
    """An Eyas drafter artifact's eagle/ export and history, or the export directory itself."""
    art = open_artifact(spec.drafter, ctx.settings)
    trained_kwargs, accuracy = None, None
    if art.exists("manifest.json"):
        manifest = read_manifest(art, kind="drafter")
        _check_diagnosable(method_of(manifest), spec.drafter)
        for name in manifest.files:
            if name.startswith(f"{EAGLE_DIR}/") or name == HISTORY:
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                fetch_verified(art, manifest, name, local / name)
        path = local / EAGLE_DIR
        if manifest.drafter is not None:
            trained_kwargs = manifest.drafter.chat_template_kwargs
        if (local / HISTORY).is_file():
            val = json.loads((local / HISTORY).read_text()).get("val") or []
            accuracy = val[-1]["acc"] if val else None
    else:
        path = local / "export"
        path.mkdir()
        for name in (CONFIG, WEIGHTS):
            if not art.exists(name):
                raise ValueError(f"drafter {spec.drafter}: no {name} (an EAGLE-3 export has config.json and "
                                 "model.safetensors)")
            (path / name).write_bytes(art.get_bytes(name))
    config = json.loads((path / CONFIG).read_text())
    _check_diagnosable(method_of_export(config), spec.drafter)
    return Exported(path, config, num_layers, _config_aux(config, num_layers), trained_kwargs, accuracy)


def _flag_fix(flag: str) -> str:
    return (f"serve it with an engine that reads `{flag}` (vLLM does; SGLang does not), or train without it")


def _static_checks(exported: Exported, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Mis-wirings the files show by themselves; returns config overrides that make the drafter load as trained."""
    overrides: dict[str, Any] = {}
    cfg = exported.config
    norms = {"norm_before_fc": "input_norm.weight", "fc_norm": "fc_norm.0.weight"}  # eyas.drafter's names
    for flag, weight in norms.items():
        if weight in weights and not cfg.get(flag):
            exported.static.append(f"the weights carry `{weight}` but config.json does not set `{flag}`: an engine "
                                   f"skips the norm the drafter was trained with; set \"{flag}\": true")
            overrides[flag] = True
    if "d2t" not in weights and cfg.get("draft_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size"):
        exported.static.append("the weights carry no d2t/t2d though the draft vocabulary is smaller than the "
                               "target's: every draft maps to the wrong token; export them from the training's draft "
                               "vocabulary")
    return overrides


def _recorded_checks(exported: Exported, target: Target) -> None:
    """What the export records about itself against the ids the engines will read and against the target, before
    any τ is measured: each contradiction is a static finding, and the aux layers it was trained on are the fix."""
    found = recorded_contradictions(exported.config, exported.num_layers,
                                    list(getattr(target.config, "architectures", None) or []))
    exported.static.extend(c.finding for c in found)
    exported.recorded_aux = next((c.trained for c in found if c.trained is not None), None)
    layout = recorded_layout(exported.config)
    if layout is not None and not found:
        try:
            check_target(layout, target)
        except WiringMismatch as e:
            exported.static.append(f"its eyas_layout says: {e}; fix: diagnose and serve it with that target")


def _recorded_variant(exported: Exported, tried: list[Variant]) -> list[Variant]:
    """The drafter fed the aux layers its eyas_layout records (marking the variant that already does, if any)."""
    aux = exported.recorded_aux
    if aux is None or aux == exported.aux_layers:  # only SGLang's ids contradict it: τ here is vLLM's reading
        return tried
    def feeds_them(v: Variant) -> bool:  # a shift of the configured ids that reads the recorded layers
        return v.aux_layers == aux and v.name.startswith("aux ids")

    if any(map(feeds_them, tried)):
        return [replace(v, recorded=True) if feeds_them(v) else v for v in tried]
    vllm_ids = [i + 1 for i in aux]
    return [*tried, Variant(
        "as recorded",
        f"the config's aux ids contradict its eyas_layout, which records out({', '.join(map(str, aux))})",
        f"set \"eagle_aux_hidden_state_layer_ids\": {vllm_ids} (vLLM) and eagle_config's "
        f"\"eagle_aux_hidden_state_layer_ids\": {list(aux)} (SGLang)", aux, recorded=True)]


def _load(exported: Exported, target: Target, dtype: torch.dtype) -> tuple[Drafter, dict[str, torch.Tensor]]:
    """The drafter as an engine loads it (missing d2t: the identity an engine falls back to), and its raw weights;
    first, what its files record against themselves and the target (`_recorded_checks`)."""
    from safetensors.torch import load_file

    _recorded_checks(exported, target)
    weights = {drafter_name(k): v for k, v in load_file(str(exported.path / WEIGHTS)).items()}
    embedding = target.model.get_input_embeddings().weight.detach()
    drafter, _ = load_drafter(exported.path, embedding, dtype, overrides=_static_checks(exported, weights),
                              missing_vocab_map=True)
    return drafter, weights


def _thinking_toggle(target: Target, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The traffic's template kwargs with thinking toggled, where the chat template has the switch."""
    template = getattr(target.tokenizer, "chat_template", None) or ""
    if "enable_thinking" not in template:
        return None
    return {**kwargs, "enable_thinking": not kwargs.get("enable_thinking", True)}


def variants(exported: Exported, drafter: Drafter, target: Target, kwargs: dict[str, Any]) -> list[Variant]:
    """The configured wiring, then each known mis-wiring (MISWIRINGS in the module docstring) that applies."""
    aux, L = exported.aux_layers, exported.num_layers
    out = [Variant("as configured", "", "", aux)]
    for d in (+1, -1):
        shifted = tuple(i + d for i in aux)
        if all(0 <= i < L for i in shifted):
            vllm_ids, sglang_ids = [i + 1 for i in shifted], list(shifted)
            out.append(Variant(
                f"aux ids {d:+d}", f"the drafter was trained on out({', '.join(map(str, shifted))}) but its config "
                f"names out({', '.join(map(str, aux))}): its layer ids are off by {-d:+d} (vLLM's id i is the input of "
                "layer i, the output of layer i-1)",
                f"set \"eagle_aux_hidden_state_layer_ids\": {vllm_ids} (vLLM) and eagle_config's "
                f"\"eagle_aux_hidden_state_layer_ids\": {sglang_ids} (SGLang)", shifted))
    for perm in itertools.permutations(range(len(aux))):
        if list(perm) != sorted(perm):
            out.append(Variant(
                f"aux order {'-'.join(map(str, perm))}", "the drafter was trained on the aux states concatenated in "
                f"another order (blocks {list(perm)} of the ascending layers); engines concatenate them ascending",
                f"reorder fc.weight's input blocks to {list(perm)} (write_fixed does)", aux, order=perm))
    d2t = drafter.d2t
    if bool((d2t != 0).any()):
        absolute = d2t - torch.arange(d2t.numel(), device=d2t.device)
        if bool((absolute >= 0).all()) and int(absolute.max()) < drafter.cfg.vocab_size:
            out.append(Variant("d2t as offsets", "d2t holds target token ids, not the offsets engines add to the "
                               "draft id (target = draft + d2t[draft])", "store d2t[i] = id_i - i (write_fixed does)",
                               aux, d2t="offsets"))
        out.append(Variant("d2t missing", "the engine read no d2t: drafts land on the wrong target tokens",
                           "ship d2t and t2d in model.safetensors", aux, d2t="identity", engine_fault=True))
    for flag in NORM_FLAGS:
        if getattr(drafter.cfg, flag):
            out.append(Variant(f"{flag} ignored", f"the engine does not apply `{flag}` (EAGLE 3.1) the drafter was "
                               "trained with", _flag_fix(flag), aux, ignore_norms=(flag,), engine_fault=True))
    toggled = exported.trained_kwargs if exported.trained_kwargs not in (None, kwargs) else _thinking_toggle(
        target, kwargs)
    if toggled is not None:
        out.append(Variant(
            f"template {json.dumps(toggled)}", f"the drafter was trained on prompts rendered with {json.dumps(toggled)}"
            f", the traffic is rendered with {json.dumps(kwargs)}: another chat template mode",
            f"serve prompts with chat_template_kwargs={json.dumps(toggled)} (per request, or vLLM's "
            "--default-chat-template-kwargs), or train on data generated in the traffic's mode", aux,
            template_kwargs=toggled))
    out.append(Variant("zero states", "the engine fed the drafter zero hidden states (a capture bug: vLLM #46301)",
                       "upgrade the engine, or serve without the feature that zeroes the states", aux,
                       zero_states=True, engine_fault=True))
    return _recorded_variant(exported, out)


class Measure:
    """τ of variants on one prompt set, sharing the target's greedy outputs per template and its passes per set of
    aux layers."""

    def __init__(self, target: Target, drafter: Drafter, source: str, n: int, kwargs: dict[str, Any],
                 max_new_tokens: int, k: int, settings, check):
        self.target, self.drafter, self.source, self.n, self.kwargs = target, drafter, source, n, kwargs
        self.max_new_tokens, self.k, self.settings, self.check = max_new_tokens, k, settings, check
        self._prompts: dict[str, tuple[list[PromptIds], list[list[int]]]] = {}
        self._passes: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def prompts(self, kwargs: dict[str, Any]) -> tuple[list[PromptIds], list[list[int]]]:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self._prompts:
            prompts = eval_prompts(self.target.tokenizer, self.source, self.n, kwargs, self.settings)
            outputs = greedy(self.target, [p.ids for p in prompts], self.max_new_tokens, stop_ids(self.target),
                             check=self.check)
            self._prompts[key] = (prompts, outputs)
        return self._prompts[key]

    def _pass(self, kwargs: dict[str, Any], aux_layers: tuple[int, ...]):
        key = (json.dumps(kwargs, sort_keys=True), aux_layers)
        if key not in self._passes:
            on = self.drafter.fc.weight.device
            passes = []
            for p, out in zip(*self.prompts(kwargs), strict=True):
                self.check()
                ids = torch.tensor([p.ids + out], device=on)
                passes.append((ids, *target_pass(self.target, aux_layers, ids, K_MAX)))
            self._passes[key] = passes
        return self._passes[key]

    def runs(self, v: Variant) -> tuple[list[PromptIds], list[list[int]]]:
        kwargs = self.kwargs if v.template_kwargs is None else v.template_kwargs
        prompts, _ = self.prompts(kwargs)
        drafter = _variant_drafter(self.drafter, v)
        runs = []
        for p, (ids, aux, preds) in zip(prompts, self._pass(kwargs, v.aux_layers), strict=True):
            if v.order:  # fc receives the blocks in this order
                aux = torch.cat([aux.chunk(len(v.order), -1)[i] for i in v.order], -1)
            if v.zero_states:
                aux = torch.zeros_like(aux)
            runs.append(drafter_runs(drafter, ids, aux, preds, len(p.ids), K_MAX))
        return prompts, runs

    def tau(self, v: Variant) -> float:
        return chain_acceptance(self.runs(v)[1], self.k)["acceptance_length"]


def _variant_drafter(base: Drafter, v: Variant) -> Drafter:
    """The drafter as the variant reads it: d2t converted or dropped, norms skipped."""
    if v.d2t == "given" and not v.ignore_norms:
        return base
    drafter = Drafter(replace(base.cfg, **{f: False for f in v.ignore_norms}))
    drafter.load_state_dict(base.state_dict(), strict=False)  # the ignored norms' weights are not read
    drafter.to(base.fc.weight.device, base.fc.weight.dtype).eval()
    if v.d2t == "offsets":
        drafter.d2t.sub_(torch.arange(drafter.d2t.numel(), device=drafter.d2t.device))
    elif v.d2t == "identity":
        drafter.d2t.zero_()
    return drafter


def _served(spec: Spec, ctx: StageContext, exported: Exported, prompts: list[PromptIds]) -> dict | None:
    """The endpoint's spec-decode counters over the prompts (a vLLM started with the drafter with `serve`)."""
    if spec.endpoint:
        stack: contextlib.AbstractContextManager = contextlib.nullcontext(spec.endpoint)
    elif spec.serve:
        if not ctx.settings.vllm_command:
            raise ValueError("serve=true needs EYAS_VLLM_COMMAND (the command that starts vLLM's OpenAI server)")
        config = method_of_export(exported.config).speculative_config(str(exported.path), spec.k)
        stack = launch.vllm(ctx.settings.vllm_command, resolve_target(spec.target), config,
                            check=ctx.check)
    else:
        return None
    with stack as url:
        out = timed_completions(url, prompts, spec.max_new_tokens, counters=True,
                                api_key=ctx.settings.endpoint_api_key.get_secret_value()
                                if ctx.settings.endpoint_api_key else None)
    return {"acceptance_length": out["acceptance_length"], "drafts": out["drafts"], "accepted": out["accepted"],
            "accepted_per_pos": out["accepted_per_pos"], "url": out["url"]}


def significant(tau: float) -> float:
    """How far τ must move for a wiring to matter. Every variant runs on the same prompts and the same target
    outputs, so a difference is the wiring's, not chance; but a drafter that reads its aux states weakly moves a little
    with any change (a random-weight target: ±0.03)."""
    return max(0.03, 0.05 * (tau - 1))


def verdict(rows: list[dict], served: float | None, expected: float | None, static: list[str],
            trained_kwargs: dict[str, Any] | None) -> tuple[str, dict]:
    """One sentence, and the variant it points at (or {}): what the files show, the traffic rendered in another mode
    than the drafter's training data (where its artifact records it), the mis-wiring that explains what the engine
    measured, or the one that brings τ to what the drafter can do."""
    base = rows[0]["tau"]
    margin = significant(base)
    best = max((r for r in rows[1:] if not r["engine_fault"]), key=lambda r: r["tau"], default=None)
    if static:
        recorded = next((r for r in rows if r.get("recorded")), {})
        measured = f" (τ {base:.3f} as configured, {recorded['tau']:.3f} as recorded)" if recorded else ""
        return f"the export itself is mis-wired: {static[0]}{measured}", recorded
    template = next((r for r in rows if r["template_kwargs"] is not None and r["template_kwargs"] == trained_kwargs),
                    None)
    if template is not None:
        return (f"τ {base:.3f} on the traffic as rendered, {template['tau']:.3f} rendered as the drafter's training "
                f"data was: {template['cause']}; fix: {template['fix']}", template)
    if served is not None and served < base - margin:
        closest = min(rows[1:], key=lambda r: abs(r["tau"] - served))
        return (f"served τ {served:.3f} is below the {base:.3f} the drafter gives as configured: the engine feeds "
                f"it as '{closest['name']}' does ({closest['tau']:.3f}): {closest['cause']}; fix: {closest['fix']}",
                closest)
    if best is not None and best["tau"] > base + margin:
        return (f"τ {base:.3f} as configured, {best['tau']:.3f} with '{best['name']}': {best['cause']}; fix: "
                f"{best['fix']}", best)
    if expected is not None and expected > base + margin:
        return (f"τ {base:.3f} is below the {expected:.3f} its training accuracy promises, and no known mis-wiring "
                "explains it: the prompts differ from its training data (compare `traffic`)", {})
    said = f" and served {served:.3f}" if served is not None else ""
    return _within_noise(rows, margin, said) or (
        f"no mis-wiring found: τ {base:.3f} in-process{said}; none of the known changes does better", {})


def _within_noise(rows: list[dict], margin: float, said: str) -> tuple[str, dict] | None:
    """Where variants give τ within `margin` of the configured wiring's, the measure cannot tell them from it: said
    so with the numbers, not as 'no mis-wiring found'."""
    base = rows[0]["tau"]
    close = [r for r in rows[1:] if abs(r["tau"] - base) <= margin]
    if not close:
        return None
    figures = ", ".join(f"'{r['name']}' {r['tau']:.3f}" for r in close)
    return (f"cannot tell at this τ: {base:.3f} in-process as configured{said}, and {figures}, within the "
            f"±{margin:.3f} this measure resolves; the drafter reads its states too weakly here to tell these wirings "
            "apart (measure on more prompts, or a drafter that accepts more)", {})


def _write_fixed(exported: Exported, chosen: dict, weights: dict[str, torch.Tensor], out: Path) -> list[str]:
    """The export with the chosen variant's fix applied; returns what changed."""
    from safetensors.torch import save_file

    cfg, changed = json.loads(json.dumps(exported.config)), []
    weights = dict(weights)
    aux = exported.recorded_aux or chosen.get("aux_layers")  # what the files record wins over what τ chose
    if aux and (tuple(aux) != exported.aux_layers or exported.recorded_aux):
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in aux]
        cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = list(aux)
        cfg["eagle_config"]["use_aux_hidden_state"] = True
        changed.append("eagle_aux_hidden_state_layer_ids")
    if chosen.get("order"):
        blocks = weights["fc.weight"].chunk(len(chosen["order"]), 1)
        # fc was trained on blocks in `order`; engines feed them ascending: column block j takes the weights that
        # read ascending block j
        inverse = [chosen["order"].index(j) for j in range(len(chosen["order"]))]
        weights["fc.weight"] = torch.cat([blocks[i] for i in inverse], 1).contiguous()
        changed.append("fc.weight input blocks")
    if chosen.get("d2t") == "offsets":
        weights["d2t"] = weights["d2t"] - torch.arange(weights["d2t"].numel())
        changed.append("d2t")
    for line in exported.static:
        for flag in ("norm_before_fc", "fc_norm"):
            if f"`{flag}`" in line:
                cfg[flag] = True
                changed.append(flag)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    names_of = speculators_name if "transformer_layer_config" in cfg else (lambda n: n)
    save_file({names_of(k): v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    return changed


def _html(d: dict) -> str:
    rows = "".join(f"<tr><td>{html.escape(r['name'])}</td><td>{r['tau']:.3f}</td><td>{html.escape(r['cause'])}</td>"
                   f"<td>{html.escape(r['fix'])}</td></tr>" for r in d["variants"])
    figures = "".join(f"<li>{html.escape(k)}: {v if v is None else round(v, 3)}</li>"
                      for k, v in d["acceptance"].items())
    return (f"<!doctype html><meta charset=utf-8><title>eyas diagnose</title><h1>Diagnosis</h1>"
            f"<p><b>{html.escape(d['verdict'])}</b></p><ul>{figures}</ul>"
            f"<table border=1 cellpadding=4><tr><th>variant</th><th>τ (in-process)</th><th>cause</th><th>fix</th></tr>"
            f"{rows}</table>")


def _on_traffic(spec: Spec, ctx: StageContext, target: Any, drafter: Any, kwargs: dict, variant: Variant) -> dict:
    """τ of `variant` (the drafter as exported) on the spec's traffic prompts, in all and per category."""
    on_traffic = Measure(target, drafter, spec.traffic, spec.traffic_prompts, kwargs, spec.max_new_tokens, spec.k,
                         ctx.settings, ctx.check)
    prompts, runs = on_traffic.runs(variant)
    per_category: dict[str, list] = {}
    for p, r in zip(prompts, runs, strict=True):
        per_category.setdefault(p.category or "all", []).append(r)
    return {"acceptance_length": chain_acceptance(runs, spec.k)["acceptance_length"],
            "per_category": {c: chain_acceptance(rs, spec.k)["acceptance_length"] for c, rs in per_category.items()}}


def run(spec: Spec, ctx: StageContext) -> StageResult:
    place = placement(ctx.settings, spec.dtype)
    target = load_target(spec.target, place)
    num_layers = target.model.config.num_hidden_layers
    with tempfile.TemporaryDirectory(prefix="eyas-diagnose-") as tmp:
        exported = _fetch(spec, ctx, Path(tmp), num_layers)
        drafter, weights = _load(exported, target, place.dtype)
        kwargs = spec.chat_template_kwargs if spec.chat_template_kwargs is not None else (
            exported.trained_kwargs or {})
        measure = Measure(target, drafter, spec.prompts, spec.num_prompts, kwargs, spec.max_new_tokens, spec.k,
                          ctx.settings, ctx.check)
        tried = variants(exported, drafter, target, kwargs)
        rows = []
        for i, v in enumerate(tried):
            ctx.check()
            rows.append({**asdict(v), "tau": measure.tau(v)})
            ctx.progress(i + 1, len(tried), "variants")
            log.info("diagnose: %-28s τ %.3f", v.name, rows[-1]["tau"])
        served = _served(spec, ctx, exported, measure.prompts(kwargs)[0])
        accuracy = spec.expected_accuracy or exported.accuracy
        expected = expected_acceptance_length(accuracy, spec.k) if accuracy else None
        sentence, chosen = verdict(rows, served["acceptance_length"] if served else None, expected, exported.static,
                                   exported.trained_kwargs)
        traffic = _on_traffic(spec, ctx, target, drafter, kwargs, tried[0]) if spec.traffic else None
        diagnosis = {
            "drafter": spec.drafter, "target": spec.target, "k": spec.k, "prompts": spec.prompts,
            "num_prompts": spec.num_prompts, "chat_template_kwargs": kwargs,
            "configured_aux_layers": list(exported.aux_layers),
            "acceptance": {"in_process": rows[0]["tau"], "served": served["acceptance_length"] if served else None,
                           "expected": expected},
            "served": served, "traffic": traffic, "static": exported.static, "variants": rows,
            "verdict": sentence, "cause": chosen.get("name"), "fix": chosen.get("fix"),
        }
        writer = ArtifactWriter(ctx.output)
        if spec.write_fixed and (chosen or exported.static):
            changed = _write_fixed(exported, chosen, weights, Path(tmp) / "fixed")
            diagnosis["fixed"] = {"changed": changed, "path": "fixed/"}
            for name in (CONFIG, WEIGHTS):
                writer.put_file(f"fixed/{name}", Path(tmp) / "fixed" / name)
        writer.put_bytes("diagnosis.json", json.dumps(diagnosis, indent=1, default=list).encode())
        writer.put_bytes("diagnosis.html", _html(diagnosis).encode())
        shutil.rmtree(Path(tmp) / "fixed", ignore_errors=True)
    metrics = {"in_process_acceptance_length": rows[0]["tau"], "served_acceptance_length": diagnosis["acceptance"]
               ["served"], "expected_acceptance_length": expected, "cause": chosen.get("name"), "verdict": sentence}
    writer.commit(Manifest(kind="diagnosis", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
                           inputs=[spec.drafter], metrics=metrics))
    log.info("diagnosis: %s", sentence)
    out = ctx.output.uri
    artifacts = {"diagnosis_json": f"{out}/diagnosis.json", "diagnosis_html": f"{out}/diagnosis.html"}
    if "fixed" in diagnosis:
        artifacts["fixed"] = f"{out}/fixed"
    return StageResult(output_uri=out, metrics=metrics, artifacts=artifacts)

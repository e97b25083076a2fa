"""A trained drafter's exports, each a directory with config.json + model.safetensors, and the EAGLE-3 reader that
THE loader (eyas.methods.load_drafter) calls for them. The drafter artifact (drafters/{id}/) holds:

  eagle/        the EAGLE/SpecForge layout vLLM and SGLang load (docs/eagle3.md §2.1, §2.2):
                fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t int64 [Vd], t2d bool [V] (both omitted
                when Vd = V: the identity); no embed_tokens.
  speculators/  the speculators format (docs/eagle3.md §2.3): the same tensors with midlayer.* named layers.0.*, plus
                embed_tokens.weight (the target's, [V, H]: the speculators library refills it from the verifier
                only where it is NaN, so without it its forward embeds every token as zeros), and a config with
                speculators_model_type eagle3, transformer_layer_config, speculators_config, the aux layer ids
                (vLLM numbering, always) and an explicit norm_before_residual false (vLLM assumes true when the
                key is missing). Its verifier is the name the train spec gives, else the target's hub id where
                one is known (`speculators_verifier`), never the target's path on this machine; the speculators
                library opens it (config and weights) when it loads the export, so where none is named, whoever
                loads the export names the verifier there (eyas_layout names the target).

  history.json  the training curves: {"train": [{step, loss, acc[k], lr, tokens_per_s}], "val": [{step, loss, acc[k]}]}

Before writing, every config is checked against the features' layout: the layers vLLM would capture for it must be
exactly the layers the drafter was trained on (eyas.layout.check_serving), or export fails. An engine that cannot
serve a layout at all (SGLang when the first aux id is not out(1): its versions disagree on the offset) is listed
as unsupported, with its reason, instead of failing the export.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from eyas.defaults import EAGLE_DIR, SPECULATORS_DIR
from eyas.drafter import NORM_FLAGS, Drafter, DrafterConfig
from eyas.layout import Layout, LayoutMismatch, check_serving
from eyas.target import hub_id

if TYPE_CHECKING:
    from eyas.methods.eagle3 import Eagle3

WEIGHTS, CONFIG = "model.safetensors", "config.json"
HISTORY = "history.json"
# Drafter module prefix → speculators tensor prefix (the one decoder layer); every other name is the same in the
# drafter, the EAGLE layout and the speculators format. The one map, read in both directions below.
_SPECULATORS_PREFIXES = {"midlayer.": "layers.0."}
# Fields of the EAGLE config that are not part of a plain Llama layer config.
_EAGLE_ONLY = ("architectures", "draft_vocab_size", "norm_before_residual", "target_hidden_size", "eyas_layout",
               "eagle_config", "eagle_aux_hidden_state_layer_ids", "torch_dtype", "mask_token_id", *NORM_FLAGS)
MASK_HIDDEN = "mask_hidden"  # P-EAGLE's learned state [n_aux·H_t] (speculators: [1, 1, n_aux·H_t])


def speculators_name(name: str) -> str:
    """Drafter (EAGLE-layout) tensor name → speculators tensor name."""
    for ours, theirs in _SPECULATORS_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def drafter_name(name: str) -> str:
    """Tensor name in either export → the drafter's module name."""
    for ours, theirs in _SPECULATORS_PREFIXES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def eagle_config(cfg: DrafterConfig, layout: Layout, dtype: str) -> dict[str, Any]:
    """config.json in the EAGLE/SpecForge layout that vLLM and SGLang load (docs/eagle3.md §2.2)."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,  # the target's (the drafter trained with it)
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": dtype,
        "eyas_layout": layout.to_dict(),
        **cfg.norms,  # EAGLE 3.1's flags, only those that are on (vLLM reads them at the top level)
    }
    if cfg.mask_token_id is not None:  # P-EAGLE: vLLM serves it with "parallel_drafting": true
        out["mask_token_id"] = cfg.mask_token_id
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    if not layout.is_default:
        # Per-engine numbering (docs/eagle3.md §3.4): vLLM reads top-level input-to ids, SGLang eagle_config's
        # output-of ids.
        out["eagle_aux_hidden_state_layer_ids"] = layout.vllm_ids
        out["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layout.sglang_ids}
    return out


def drafter_config_from_eagle(cfg: dict[str, Any], num_aux: int) -> DrafterConfig:
    """The DrafterConfig of an EAGLE-layout config.json; `num_aux` comes from the checkpoint's fc width."""
    return DrafterConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]), num_aux=num_aux,
        rope_theta=cfg.get("rope_theta", 10000.0), max_position_embeddings=cfg["max_position_embeddings"],
        rope_scaling=cfg.get("rope_scaling"), mask_token_id=cfg.get("mask_token_id"),
        **{k: bool(cfg.get(k, False)) for k in NORM_FLAGS},
    )


def export_tensors(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """EAGLE-layout tensors from a drafter state dict: float weights in `dtype`, d2t int64, t2d bool, and no
    embedding (docs/eagle3.md §2.1)."""
    out = {}
    for name, t in weights.items():
        if name.startswith("embed_tokens."):
            continue
        t = t.detach().cpu()
        out[name] = (t.to(torch.int64) if name == "d2t" else t.to(torch.bool) if name == "t2d" else t.to(dtype))
        out[name] = out[name].contiguous()
    return out


def speculators_verifier(target: str, target_cfg: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The speculators config's verifier block for `target` (its config.json `target_cfg`): `name` when given (the
    train spec's `verifier`, as given), else the target's hub id where it is known (eyas.target.hub_id), else null,
    never the target's path on this machine. The speculators library opens the verifier (config and weights) when
    it loads the export; vLLM serves it when given the export as its model."""
    return {"name_or_path": name or hub_id(target, target_cfg), "architectures": target_cfg.get("architectures", [])}


def speculators_config(eagle_cfg: dict[str, Any], layout: Layout, verifier: dict[str, Any],
                       speculative_tokens: int, method: Eagle3) -> dict[str, Any]:
    """The speculators format's config.json for the EAGLE-layout one, as the speculators library names `method`
    (eagle3, or peagle with its mask token)."""
    layer = {k: v for k, v in eagle_cfg.items() if k not in _EAGLE_ONLY}
    layer["architectures"] = ["LlamaForCausalLM"]
    cfg: dict[str, Any] = {
        "architectures": [method.speculators_architecture],
        "speculators_model_type": method.speculators_type,
        "transformer_layer_config": layer,
        "draft_vocab_size": eagle_cfg["draft_vocab_size"],
        "norm_before_residual": False,
        "target_hidden_size": eagle_cfg.get("target_hidden_size", eagle_cfg["hidden_size"]),
        "speculators_config": {
            "algorithm": method.speculators_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "torch_dtype": eagle_cfg["torch_dtype"],
        "eyas_layout": layout.to_dict(),
        **{k: True for k in NORM_FLAGS if eagle_cfg.get(k)},
    }
    if method.parallel:  # P-EAGLE's mask token
        cfg["mask_token_id"] = eagle_cfg["mask_token_id"]
    # vLLM reads these as input-to-layer ids (docs/eagle3.md §3.4); written even for the default layers, since the
    # speculators library otherwise resolves them from the verifier, which may name none
    cfg["eagle_aux_hidden_state_layer_ids"] = layout.vllm_ids
    return cfg


def unsupported_engines(layout: Layout, eagle_cfg: dict[str, Any], spec_cfg: dict[str, Any],
                        method: Eagle3) -> dict[str, str]:
    """Check that each engine would feed the drafter exactly the aux layers of `layout`. vLLM must (it loads both
    exports; LayoutMismatch otherwise); an engine that cannot serve this layout is returned with its reason, else
    one that cannot serve `method` at all, with the method's."""
    check_serving(layout, eagle_cfg, "vllm")
    check_serving(layout, spec_cfg, "vllm")  # vLLM copies the top-level ids of a speculators config
    unsupported: dict[str, str] = dict(method.refused_engines)
    norms = [k for k in NORM_FLAGS if eagle_cfg.get(k)]
    try:
        check_serving(layout, eagle_cfg, "sglang")
        if norms:
            raise LayoutMismatch(f"its llama_eagle3 reads none of EAGLE 3.1's norms ({', '.join(norms)})")
    except LayoutMismatch as e:
        unsupported["sglang"] = str(e)
    return unsupported


def export_drafter(cfg: DrafterConfig, weights: dict[str, torch.Tensor], layout: Layout, out: Path, dtype: str,
                   verifier: dict[str, Any], speculative_tokens: int,
                   method: Eagle3) -> tuple[list[Path], dict[str, str]]:
    """Write eagle/ and speculators/ for a drafter of `method` (EAGLE-3 or P-EAGLE: its config and state dict,
    embed_tokens.weight included: the target's embedding) under `out`; `verifier` is the speculators config's
    verifier block. Returns the files
    written (relative to `out`) and the engines that cannot serve this layout, with why. Refuses (LayoutMismatch,
    nothing written) a layout vLLM would not feed exactly, and a drafter whose fc does not take the layout's
    aux layers."""
    if cfg.num_aux != len(layout.aux_layers):
        raise LayoutMismatch(f"the drafter concatenates {cfg.num_aux} aux layers, the layout {len(layout.aux_layers)}")
    eagle_cfg = eagle_config(cfg, layout, dtype)
    spec_cfg = speculators_config(eagle_cfg, layout, verifier, speculative_tokens, method)
    unsupported = unsupported_engines(layout, eagle_cfg, spec_cfg, method)
    tensors = export_tensors(weights, getattr(torch, dtype))
    missing = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
               *([MASK_HIDDEN] if method.parallel else [])} - tensors.keys()
    if "embed_tokens.weight" not in weights:
        missing.add("embed_tokens.weight")
    if missing:
        raise ValueError(f"drafter weights lack {sorted(missing)}")
    if cfg.draft_vocab_size == cfg.vocab_size:
        # The whole vocabulary: d2t is all zeros. vLLM then has no d2t parameter and refuses one in the
        # checkpoint; SGLang reads draft ids as target ids (docs/eagle3.md §5).
        del tensors["d2t"], tensors["t2d"]
    embed = weights["embed_tokens.weight"].detach().cpu().to(getattr(torch, dtype)).contiguous()
    renamed = {**{speculators_name(k): v for k, v in tensors.items()}, "embed_tokens.weight": embed}
    if MASK_HIDDEN in renamed:  # the speculators library's parameter is [1, 1, n_aux·H_t]
        renamed[MASK_HIDDEN] = renamed[MASK_HIDDEN].reshape(1, 1, -1).contiguous()
    written = []
    for sub, config, saved in ((EAGLE_DIR, eagle_cfg, tensors), (SPECULATORS_DIR, spec_cfg, renamed)):
        (out / sub).mkdir(parents=True, exist_ok=True)
        (out / sub / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(saved, str(out / sub / WEIGHTS), metadata={"format": "pt"})
        written += [Path(sub) / CONFIG, Path(sub) / WEIGHTS]
    return written, unsupported


def load_eagle(path: Path, cfg_json: dict[str, Any], embed_weight: torch.Tensor, dtype: torch.dtype,
               overrides: dict[str, Any] | None, missing_vocab_map: bool) -> Drafter:
    """An EAGLE-3 or P-EAGLE export (config.json `cfg_json`) → Drafter (load_drafter's arguments). The number of
    aux layers is read from fc's width ([H, n_aux·H_t]), so a drafter trained on any count loads."""
    from safetensors.torch import load_file

    flat = cfg_json.get("transformer_layer_config") or cfg_json  # speculators nests the layer config
    flat = {**flat, **{k: cfg_json[k] for k in ("draft_vocab_size", "target_hidden_size", "mask_token_id", *NORM_FLAGS)
                       if k in cfg_json},
            **(overrides or {})}
    state = {drafter_name(k): v for k, v in load_file(str(Path(path) / WEIGHTS)).items()}
    if MASK_HIDDEN in state:
        state[MASK_HIDDEN] = state[MASK_HIDDEN].reshape(-1)
    target_hidden = flat.get("target_hidden_size", flat["hidden_size"])
    fc_in = state["fc.weight"].shape[1] if "fc.weight" in state else 0
    if fc_in == 0 or fc_in % target_hidden:
        raise ValueError(f"drafter checkpoint {path}: fc.weight takes {fc_in} inputs, not a multiple of the "
                         f"target hidden size {target_hidden}")
    model = Drafter(drafter_config_from_eagle(flat, fc_in // target_hidden))
    state["embed_tokens.weight"] = embed_weight
    if "d2t" not in state and (missing_vocab_map or model.cfg.draft_vocab_size == model.cfg.vocab_size):
        # exported without the identity (or read as an engine reads a checkpoint that lacks it)
        state["d2t"] = torch.zeros(model.cfg.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.zeros(model.cfg.vocab_size, dtype=torch.bool)
        state["t2d"][: model.cfg.draft_vocab_size] = True
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
    model.to(embed_weight.device, dtype)  # the drafter sits where the target's embedding is
    return model.eval()

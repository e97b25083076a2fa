"""Ablation: what moves τ at equal wall time. Each variant is `eyas run --minutes N …`: the budget planner
(orchestration/budget.py) sizes every variant's data to the same wall time, so a variant whose answers are longer
or shorter (--max-tokens) gets fewer or more prompts; a --set that makes a stage dearer (more epochs) is not
re-planned, and its wall time column shows what it cost. Prints, per variant and seed, τ on held-out
MT-bench with its spread over prompts (standard error of the mean of per-prompt τ), τ on the second held-out set
the report carries when the evaluator has one (`report.json: second_set`), and the wall time; then the mean per
variant over seeds and its difference from the baseline.

    .venv/bin/python bench/ablate.py --minutes 10 --seeds 2 --variants baseline sampled-0.7 lr-1e-3
    .venv/bin/python bench/ablate.py --list

Run on a quiet machine: every variant is a whole `eyas run` (N minutes each, per seed).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

# lever → the `eyas run` arguments it changes (the baseline is the defaults); --set STAGE.FIELD=VALUE items, or
# run flags the budget planner sizes the run with (--max-tokens: fewer tokens per answer buy more prompts)
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # data: the labels are the target's own hidden states, so sampled answers still teach its distribution
    "sampled-0.7": ["--set", "generate.sampling.temperature=0.7"],
    "sampled-1.0": ["--set", "generate.sampling.temperature=1.0"],
    "two-turns": ["--set", "generate.synth_turns=2", "--set", "generate.max_turns=2"],
    "free-synthesis": ["--set", "generate.synth_openers=[]"],  # Magpie unsteered, the default before the task mix
    "answers-128": ["--max-tokens", "128"],
    "answers-96": ["--max-tokens", "96"],
    "answers-64": ["--max-tokens", "64"],
    "batch-96": ["--batch", "96"],  # in-process generation batch: more tokens/s, prompts in whole batches of 96
    # recipe
    "lr-1e-3": ["--set", "train.lr=0.001"],
    "epochs-2": ["--set", "train.epochs=2"],
    "epochs-4": ["--set", "train.epochs=4"],
    "ttt-5": ["--set", "train.ttt_steps=5"],
    "vocab-8192": ["--set", "train.draft_vocab_size=8192"],
    "batch-1024": ["--set", "train.batch_tokens=1024"],
}
ROOT = Path(__file__).resolve().parents[1]


def run_variant(name: str, seed: int, minutes: float, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "orchestration.cli", "run", "--minutes", str(minutes), "--workdir",
           str(workdir / f"{name}-{seed}"), *VARIANTS[name], "--set", f"generate.synth_seed={seed}",
           "--set", f"train.seed={seed}",
           "--live", "off"]  # the levers' τ at equal pipeline time: the live check's share would blur them
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        return {"variant": name, "seed": seed, "wall_s": wall, "error": proc.stdout[-600:] + proc.stderr[-600:]}
    uri = re.search(r"^  report_json: (\S+)$", proc.stdout, re.M)[1]
    report = json.loads(Path(unquote(urlparse(uri).path)).read_text())
    taus = [1 + sum(r["accepted_per_pos"]) / r["drafts"] for r in report["acceptance"]["per_prompt"] if r["drafts"]]
    second = report.get("second_set") or {}
    return {"variant": name, "seed": seed, "wall_s": wall, "tau": report["acceptance_length"],
            "tau_se": statistics.stdev(taus) / math.sqrt(len(taus)) if len(taus) > 1 else None,
            "per_position": report["per_position_acceptance"], "tau_second": second.get("acceptance_length"),
            "plan": re.search(r"^plan for .*$", proc.stdout, re.M)[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="budget of every run (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=1, help="runs per variant (synthesis and training seed)")
    p.add_argument("--variants", nargs="+", default=["baseline", "sampled-0.7", "lr-1e-3", "epochs-2"],
                   choices=sorted(VARIANTS), metavar="VARIANT")
    p.add_argument("--workdir", type=Path, default=Path("eyas-ablate"))
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON lines here")
    p.add_argument("--list", action="store_true", help="list the variants and what they set")
    args = p.parse_args()
    if args.list:
        for name, sets in VARIANTS.items():
            print(f"{name:<14} {' '.join(sets) or '(defaults)'}")
        return
    rows = []
    for seed in range(args.seeds):
        for name in args.variants:
            row = run_variant(name, seed, args.minutes, args.workdir.resolve())
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    base = [r["tau"] for r in rows if r["variant"] == "baseline" and "tau" in r]
    print("\n| variant | runs | τ MT-bench (mean) | ± se over prompts | vs baseline | τ second set | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.variants:
        ok = [r for r in rows if r["variant"] == name and "tau" in r]
        if not ok:
            print(f"| {name} | 0 | failed | | | | |")
            continue
        tau = statistics.mean(r["tau"] for r in ok)
        se = statistics.mean(r["tau_se"] for r in ok if r["tau_se"] is not None)
        second = [r["tau_second"] for r in ok if r["tau_second"] is not None]
        delta = f"{tau - statistics.mean(base):+.3f}" if base else ""
        second_text = f"{statistics.mean(second):.3f}" if second else ""
        wall = statistics.mean(r["wall_s"] for r in ok)
        print(f"| {name} | {len(ok)} | {tau:.3f} | {se:.3f} | {delta} | {second_text} | {wall:.0f} |")

if __name__ == "__main__":
    main()

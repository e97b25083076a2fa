"""`eyas run`: generate → extract → train → evaluate on the embedded default, with progress for each stage.

The run fits a time budget (`--minutes`, default 10): it measures this machine's rates in its first seconds and
sizes the prompts and the evaluation to fit (orchestration/budget.py), prints the plan, and ends with the stage
times it took beside the plan's. Defaults: the bundled SmolLM2-135M-Instruct target, prompts synthesized from it, a
local directory store. Every stage runs through the same pipeline code as the services. When the planned features
do not fit the store's disk cap (`--store-gb`), extraction and training run together on a bounded window of them
(`--features-policy`).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.target import BUNDLED

if TYPE_CHECKING:
    from orchestration.budget import FeaturesPolicy


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=Path("eyas-work"), help="everything goes under DIR (default: %(default)s)")
    p.add_argument("--target", default=BUNDLED, help="target model: HF directory or %(default)s")
    p.add_argument("--prompts", default=None,
                   help="training prompt file (default: prompts synthesized from the target itself)")
    p.add_argument("--endpoint", default=None, help="OpenAI-compatible endpoint for generation (default: in-process)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="wall-time budget: prompts and evaluation are sized to fit it here (default: %(default)s)")
    # defaults measured against alternatives on 2 cores: bench/README.md ("eyas run defaults")
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (default: the budget's plan)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max new tokens per answer (default: 96, shorter only when the budget is under one batch)")
    p.add_argument("--batch", type=int, default=96,
                   help="most requests generated at once (in-process: one batch; the prompts run in balanced "
                   "batches) (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=None, help="trainer steps (default: the trainer's CPU default)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="MT-bench prompts to evaluate on (default: the budget's plan, 20 at 10 minutes)")
    from orchestration.budget import FEATURES_POLICIES

    p.add_argument("--features-policy", choices=FEATURES_POLICIES, default="auto",
                   help="how the features reach training: cache (extract them all, then train), first_epoch (train on "
                   "the shards as they land and keep them for later epochs), recompute (extract every epoch again "
                   "while training, the store holding at most --store-gb); auto: cache when the planned features fit "
                   "--store-gb, else recompute (default: %(default)s)")
    p.add_argument("--store-gb", type=_positive, default=None,
                   help="disk for the features in the store, GiB (default: half the free space of the workdir's "
                   "filesystem)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                   help="override a field of a stage's spec, e.g. train.lr=0.001, generate.sampling.temperature=0.7, "
                   "evaluate.k=4 (VALUE is JSON, else a string; repeatable; bench/ablate.py uses it)")
    p.add_argument("-v", "--verbose", action="store_true")


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def half_free_gb(path: Path) -> float:
    """Half the free space of the filesystem `path` is (or will be) on, in GiB."""
    path = path.resolve()
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free / 2 / (1 << 30)


def hand_off_features(extract: dict[str, Any], train: dict[str, Any], policy: FeaturesPolicy,
                      cap_gb: float) -> None:
    """A streaming policy into the specs: the extract job streams its features to the train job (its `then`, which
    then starts with it), for the train job's epochs and shuffle seed, keeping at most `cap_gb` in the store; the
    train job's cache holds two windows of half of it. `cache` changes nothing."""
    if policy == "cache":
        return
    from services.trainer.spec import Spec as TrainSpec

    extract["stream"] = {"policy": policy, "epochs": math.ceil(train["epochs"]), "seed": train.get("seed", 0),
                         "max_store_gb": cap_gb}
    # a window (half the cap) holds whole shards: shards of at most a quarter of the cap (the default where larger)
    extract.setdefault("shard_mb", max(1, min(256, int(cap_gb * 1024 / 4))))
    train["cache_gb"] = max(train.get("cache_gb", TrainSpec.model_fields["cache_gb"].default), cap_gb)


def apply_overrides(specs: dict[str, dict], overrides: list[str]) -> None:
    """STAGE.FIELD[.FIELD…]=VALUE into specs[STAGE]; an unknown stage or a malformed item is an error that names
    it (a field the stage does not have is named by the stage's own validation)."""
    for item in overrides:
        path, sep, raw = item.partition("=")
        stage, *fields = path.split(".")
        if not sep or not fields or stage not in specs:
            raise SystemExit(f"--set {item!r}: expected STAGE.FIELD=VALUE with STAGE one of {', '.join(specs)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = specs[stage]
        for f in fields[:-1]:
            node = node.setdefault(f, {})
        node[fields[-1]] = value


def run_pipeline(args: argparse.Namespace) -> int:
    from eyas.layout import default_aux_layers
    from eyas.target import resolve_target
    from orchestration.budget import (
        ANSWER_TOKENS,
        DECODE_PROMPTS,
        batches,
        features_gb,
        features_policy,
        measure_rates,
        plan_run,
        rates_line,
        train_steps,
        val_interval,
    )
    from orchestration.embedded import EmbeddedRunner, command_line_settings
    from services.trainer.spec import CPU_PRESET

    t0 = time.monotonic()
    print(f"measuring this machine for a {args.minutes:g}-minute run ...", flush=True)
    rates = measure_rates(args.target, args.batch)
    plan = plan_run(args.minutes, rates, args.batch, args.max_tokens or ANSWER_TOKENS,
                    spent_s=time.monotonic() - t0)
    num_prompts = args.num_prompts or plan.num_prompts
    max_tokens = args.max_tokens or plan.max_tokens
    eval_prompts = args.eval_prompts or plan.eval_prompts
    print(rates_line(rates))
    print(plan.describe())
    if (num_prompts, max_tokens, eval_prompts) != (plan.num_prompts, plan.max_tokens, plan.eval_prompts):
        print(f"running with {num_prompts} prompts × {max_tokens} tokens, {eval_prompts} evaluation prompts "
              "(the flags given)")
    steps = train_steps(num_prompts, max_tokens, plan.epochs, args.train_steps)
    train: dict = {"stage": "train", "target": args.target, **CPU_PRESET, "epochs": plan.epochs,
                   "val_interval": val_interval(steps)}
    if args.train_steps:
        train["steps"] = args.train_steps
    evaluate: dict = {"stage": "evaluate", "target": args.target, "num_prompts": eval_prompts,
                      "decode_prompts": DECODE_PROMPTS}
    extract: dict = {"stage": "extract", "target": args.target}
    spec = {
        **({"prompts": args.prompts, "limit": num_prompts} if args.prompts else {"synthesize": num_prompts}),
        "endpoint": args.endpoint, "target": args.target, "max_turns": 1,
        "concurrency": args.batch if args.endpoint else max(batches(num_prompts, args.batch)),
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    apply_overrides({"generate": spec, "extract": extract, "train": train, "evaluate": evaluate}, args.overrides)
    config = json.loads((resolve_target(args.target) / "config.json").read_text())
    hidden = config["hidden_size"]
    n_aux = len(extract.get("aux_layers") or default_aux_layers(config["num_hidden_layers"]))
    planned_gb = features_gb(num_prompts, max_tokens, hidden, n_aux)
    cap_gb = args.store_gb or half_free_gb(args.workdir)
    policy, why = features_policy(args.features_policy, planned_gb, cap_gb)
    print(f"features: {policy}: {why}")
    hand_off_features(extract, train, policy, cap_gb)
    spec["then"] = [extract, train, evaluate]
    settings = command_line_settings("generate", spec, args.workdir)
    jobs = EmbeddedRunner(settings).run_job("generate", spec)
    print()
    # each job is created when the one before it succeeds (a streamed train job: when extraction starts), and last
    # updated when it ends
    for job in jobs:
        took = job.updated_at - job.created_at
        planned = plan.seconds.get(job.stage)
        print(f"  {job.stage:<9} {job.state:<10} {took:6.0f} s (planned {planned:.0f} s)  "
              f"{job.artifacts.get('output', '')}")
    report = jobs[-1]
    if report.stage != "evaluate" or report.state != "succeeded":
        print("pipeline did not finish; see the job records above")
        return 1
    print(f"\nacceptance length τ = {report.metrics.get('acceptance_length')}  "
          f"(K = {report.metrics.get('k')}, in {time.monotonic() - t0:.0f} s of a {args.minutes:g}-minute budget)")
    for name, uri in sorted(report.artifacts.items()):
        print(f"  {name}: {uri}")
    trained = next(j for j in jobs if j.stage == "train")
    print("drafter exports (vLLM/SGLang: eagle; speculators):")
    for name, uri in sorted(trained.artifacts.items()):
        if name != "output":
            print(f"  {name}: {uri}")
    if report.metrics.get("serving_decision"):
        print(f"\n{report.metrics['serving_decision']}")
    return 0

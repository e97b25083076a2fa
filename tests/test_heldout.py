"""The evaluator refuses to score on prompts the drafter was trained on (lineage: features → dataset)."""
from __future__ import annotations

from collections import Counter

import pytest

from eyas.manifest import ArtifactWriter, Manifest
from eyas.prompts import bundled_prompt_file, load_prompts, spread_sample
from eyas.settings import Settings
from eyas.store import Artifact, LocalStore
from services.evaluator.heldout import TrainedOnEvalPrompts, check_held_out
from tests.datasets import write_dataset


def _features_from(tmp_path, conversations) -> str:
    data = write_dataset(tmp_path / "data", conversations=conversations)
    feats = tmp_path / "features"
    ArtifactWriter(Artifact(LocalStore(feats))).commit(Manifest(kind="features", id="f", inputs=[data]))
    return str(feats)


def test_refuses_trained_on_evaluation_prompts(tmp_path):
    mt = load_prompts(bundled_prompt_file("mt_bench"))
    # 5 of MT-bench's 80 are spread evenly: indices 0, 16, 32, 48, 64 are scored, so 16 is checked and 2 is not
    feats = _features_from(tmp_path, [(mt[16].user_turns[0], "an answer"), ("Unrelated question?", "ok")])
    with pytest.raises(TrainedOnEvalPrompts, match="1 of 5 evaluation prompts were trained on"):
        check_held_out("bundled:mt_bench", 5, feats, Settings())
    assert check_held_out("bundled:mt_bench", 5, _features_from(tmp_path / "b", [(mt[2].user_turns[0], "x")]),
                          Settings()) == 5


def test_evaluation_sample_spans_every_category_and_skips_repeats():
    mt = load_prompts(bundled_prompt_file("mt_bench"))
    picked = spread_sample(mt, 20)
    per_category = Counter(p.meta["category"] for p in picked)
    assert len(per_category) == 8 and min(per_category.values()) >= 2  # the first 20 are writing and role play
    sharegpt = load_prompts(bundled_prompt_file("sharegpt"))  # 500 conversations, 52 distinct first turns
    firsts = [p.user_turns[0] for p in spread_sample(sharegpt, 5)]
    assert len(set(firsts)) == 5
    assert len(spread_sample(sharegpt, None)) == len(spread_sample(sharegpt, 1000)) == len(
        {p.user_turns[0] for p in sharegpt})


def test_accepts_held_out_prompts(tmp_path):
    feats = _features_from(tmp_path, [("Tell me about lighthouses.", "They guide ships.")])
    assert check_held_out("bundled:mt_bench", 5, feats, Settings()) == 5

"""The evaluator refuses to score on prompts the drafter was trained on (lineage: features → dataset)."""
from __future__ import annotations

import pytest

from eyas.manifest import ArtifactWriter, Manifest
from eyas.settings import Settings
from eyas.store import Artifact, LocalStore
from services.evaluator.heldout import TrainedOnEvalPrompts, check_held_out
from eyas.prompts import bundled_prompt_file, load_prompts
from tests.datasets import write_dataset


def _features_from(tmp_path, conversations) -> str:
    data = write_dataset(tmp_path / "data", conversations=conversations)
    feats = tmp_path / "features"
    ArtifactWriter(Artifact(LocalStore(feats))).commit(Manifest(kind="features", id="f", inputs=[data]))
    return str(feats)


def test_refuses_trained_on_evaluation_prompts(tmp_path):
    mt = load_prompts(bundled_prompt_file("mt_bench"))
    feats = _features_from(tmp_path, [(mt[2].user_turns[0], "an answer"), ("Unrelated question?", "ok")])
    with pytest.raises(TrainedOnEvalPrompts, match="1 of 5 evaluation prompts were trained on"):
        check_held_out("bundled:mt_bench", 5, feats, Settings())


def test_accepts_held_out_prompts(tmp_path):
    feats = _features_from(tmp_path, [("Tell me about lighthouses.", "They guide ships.")])
    assert check_held_out("bundled:mt_bench", 5, feats, Settings()) == 5

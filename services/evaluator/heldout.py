"""The evaluator's half of the held-out guard: refuse to score on prompts the drafter was trained on.

Lineage: drafter manifest → its features → their conversations dataset → the user turns trained on. The same
near-duplicate rule as the generator's guard decides (eyas.neardup).
"""
from __future__ import annotations

from eyas.datasets import trained_user_turns
from eyas.manifest import read_manifest
from eyas.neardup import NearDupIndex
from eyas.prompts import load_eval_prompts
from eyas.settings import Settings
from eyas.store import open_artifact


class TrainedOnEvalPrompts(ValueError):
    pass


def features_user_turns(features_uri: str, settings: Settings) -> list[str]:
    """Every user turn in the conversations the features were extracted from ([] if the lineage is unknown)."""
    features = read_manifest(open_artifact(features_uri, settings), kind="features")
    return [t for dataset_uri in features.inputs for t in trained_user_turns(dataset_uri, settings)]


def check_held_out(eval_source: str, limit: int | None, features_uri: str | None, settings: Settings) -> int:
    """Raise if any evaluation prompt equals or nearly equals a trained one; returns how many were checked."""
    if not features_uri:
        return 0
    trained = NearDupIndex(features_user_turns(features_uri, settings))
    prompts = load_eval_prompts(eval_source, limit, settings)
    hits = [(p.id, hit) for p in prompts if (hit := trained.find(p.user_turns[0])) is not None]
    if hits:
        pid, text = hits[0]
        raise TrainedOnEvalPrompts(
            f"{len(hits)} of {len(prompts)} evaluation prompts were trained on (e.g. {pid}: {text[:80]!r}); "
            "score on held-out prompts")
    return len(prompts)

"""The evaluator's half of the held-out guard: refuse to score on prompts the drafter was trained on.

Lineage: drafter manifest → its features → their conversations dataset → the user turns trained on. The same
near-duplicate rule as the generator's guard decides (services.generator.dedup).
"""
from __future__ import annotations

import json

from eyas.manifest import IncompleteArtifact, read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from services.generator.core import PROMPTS_FILE, resolve_prompt_file
from services.generator.dataset import load_prompts, read_conversations
from services.generator.dedup import NearDupIndex


class TrainedOnEvalPrompts(ValueError):
    pass


def trained_user_turns(features_uri: str, settings: Settings) -> list[str]:
    """Every user turn in the conversations the features were extracted from ([] if the lineage is unknown)."""
    features = read_manifest(open_artifact(features_uri, settings), kind="features")
    turns: list[str] = []
    for dataset_uri in features.inputs:
        art = open_artifact(dataset_uri, settings)
        try:
            manifest = read_manifest(art, kind="dataset")
        except IncompleteArtifact:
            continue
        if PROMPTS_FILE in manifest.files:
            saved = json.loads(art.get_bytes(PROMPTS_FILE))
            turns += [t for p in saved["prompts"] for t in p["user_turns"]]
        else:
            records, _ = read_conversations(dataset_uri, settings)
            turns += [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]
    return turns


def check_held_out(eval_source: str, limit: int | None, features_uri: str | None, settings: Settings) -> int:
    """Raise if any evaluation prompt equals or nearly equals a trained one; returns how many were checked."""
    if not features_uri:
        return 0
    trained = NearDupIndex(trained_user_turns(features_uri, settings))
    prompts = load_prompts(resolve_prompt_file(eval_source), limit=limit)
    hits = [(p.id, hit) for p in prompts if (hit := trained.find(p.user_turns[0])) is not None]
    if hits:
        pid, text = hits[0]
        raise TrainedOnEvalPrompts(
            f"{len(hits)} of {len(prompts)} evaluation prompts were trained on (e.g. {pid}: {text[:80]!r}); "
            "score on held-out prompts")
    return len(prompts)

"""Dataset artifacts (datasets/{id}/), the generator's output and the extractor's input:

  conversations-NNNNN.jsonl  one record per prompt: id, source, messages (with reasoning_content), per-turn
                             finish_reason and usage, the sampling parameters and chat-template kwargs used
  prompts.jsonl              the job's resolved prompt list (fixed at its first run, so a resume reuses it)
  dead-letter.jsonl          prompts that failed every attempt, with the reason
  manifest.json              kind "dataset"; `dataset` names the target and its tokenizer/chat-template hash
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from eyas.manifest import IncompleteArtifact, Manifest, fetch_verified, read_manifest
from eyas.settings import Settings
from eyas.store import Artifact, open_artifact

PROMPTS_FILE = "prompts.jsonl"
DEAD_LETTER_FILE = "dead-letter.jsonl"


def shard_name(i: int) -> str:
    return f"conversations-{i:05d}.jsonl"


class TokenizerMismatch(ValueError):
    """Conversations rendered for another tokenizer or chat template than the target's."""


def read_conversations(uri: str, settings: Settings,
                       expect_tokenizer_hash: str | None = None) -> tuple[list[dict], Manifest]:
    """All conversation records of a dataset artifact, after checking manifest, sha256 and tokenizer."""
    art = open_artifact(uri, settings)
    manifest = read_manifest(art, kind="dataset")
    got = manifest.dataset.tokenizer_hash if manifest.dataset else None
    if expect_tokenizer_hash and got and got != expect_tokenizer_hash:
        raise TokenizerMismatch(
            f"dataset {uri} was generated for tokenizer/template {got}, but the target's is {expect_tokenizer_hash}"
        )
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(n for n in manifest.files if n.endswith(".jsonl") and n.startswith("conversations")):
            path = fetch_verified(art, manifest, name, Path(tmp) / name)
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records, manifest


def saved_prompts(artifact: Artifact) -> dict:
    """The prompt list a generate job fixed at its first run: {"prompts": [Prompt fields], "counts": {...}}."""
    return json.loads(artifact.get_bytes(PROMPTS_FILE))


def trained_user_turns(dataset_uri: str, settings: Settings) -> list[str]:
    """Every user turn of a dataset ([] when the artifact is incomplete)."""
    art = open_artifact(dataset_uri, settings)
    try:
        manifest = read_manifest(art, kind="dataset")
    except IncompleteArtifact:
        return []
    if PROMPTS_FILE in manifest.files:
        return [t for p in saved_prompts(art)["prompts"] for t in p["user_turns"]]
    records, _ = read_conversations(dataset_uri, settings)
    return [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]

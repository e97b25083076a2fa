"""Artifact manifests: what produced an artifact, from what, how many, and a sha256 per file.

The manifest is written last, so its presence is the commit marker: an artifact without one is incomplete, and
readers refuse it. A redelivered task that finds a manifest at its deterministic prefix does not write again.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from eyas.confine import redact
from eyas.store import Artifact

MANIFEST = "manifest.json"


@lru_cache
def code_version() -> str:
    from eyas import __version__

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


class FileEntry(BaseModel):
    sha256: str
    bytes: int


class DatasetFacts(BaseModel):
    """What the extractor reads from a dataset: which target's chat template the conversations are for."""
    target: str
    tokenizer_hash: str  # tokenizer vocabulary + chat template (eyas.target.tokenizer_hash)
    endpoint: str | None = None  # where they were generated (None: in-process); never with credentials

    @field_validator("endpoint")
    @classmethod
    def _no_secret(cls, v: str | None) -> str | None:
        return redact(v)  # a checked spec has none to carry; a manifest is read by everyone who reads the data
    # the chat template's kwargs at generation (e.g. enable_thinking): extraction renders with the same
    chat_template_kwargs: dict[str, Any] = {}


class FeaturesFacts(BaseModel):
    """What the trainer reads from features beside their layout: how the conversations were rendered."""
    chat_template_kwargs: dict[str, Any] = {}  # the dataset's, used to render every sample


class DrafterFacts(BaseModel):
    """What the evaluator reads from a drafter beside its layout: how it was trained."""
    target: str
    ttt_steps: int  # draft positions trained (the evaluator measures at least these)
    val_every: int  # sample i of the features is validation iff i % val_every == 0 (eyas.features.is_validation)
    draft_vocab_size: int
    # its drafting method's name: how it is loaded and served (eyas.methods.method_of reads it; none, as in
    # manifests written before there were methods: the default method)
    method: str | None = None
    # the chat template's kwargs its data was rendered with: the evaluator renders prompts with them, and the
    # server must too (the report says so)
    chat_template_kwargs: dict[str, Any] = {}
    # engine → why it cannot serve this drafter (e.g. SGLang's aux-id offset); absent engines serve it
    unsupported_engines: dict[str, str] = {}


class Manifest(BaseModel):
    kind: str  # dataset | features | drafter | report
    id: str
    created_at: float = Field(default_factory=time.time)
    code_version: str = Field(default_factory=code_version)
    job_spec: dict[str, Any] = {}
    inputs: list[str] = []
    counts: dict[str, int] = {}
    files: dict[str, FileEntry] = {}
    layout: dict[str, Any] | None = None  # features and drafters: eyas.layout.Layout.to_dict()
    metrics: dict[str, Any] = {}  # the stage's summary numbers; also the job's metrics when a redelivery reuses it
    dataset: DatasetFacts | None = None  # kind "dataset"
    features: FeaturesFacts | None = None  # kind "features"
    drafter: DrafterFacts | None = None  # kind "drafter"
    extra: dict[str, Any] = {}  # anything stage-specific that no other stage reads


class IncompleteArtifact(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class ArtifactWriter:
    """Uploads files under an artifact prefix, hashing each, then commits the manifest."""

    def __init__(self, artifact: Artifact):
        self.artifact = artifact
        self.files: dict[str, FileEntry] = {}

    def put_file(self, name: str, path: Path) -> None:
        self.files[name] = FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size)
        self.artifact.put_file(name, path)

    def put_bytes(self, name: str, data: bytes) -> None:
        self.files[name] = FileEntry(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
        self.artifact.put_bytes(name, data)

    def commit(self, manifest: Manifest) -> Manifest:
        manifest.files = dict(sorted({**manifest.files, **self.files}.items()))
        self.artifact.put_bytes(MANIFEST, manifest.model_dump_json(indent=2).encode())
        return manifest


def read_manifest(artifact: Artifact, kind: str | None = None) -> Manifest:
    if not artifact.exists(MANIFEST):
        raise IncompleteArtifact(f"{artifact.uri} has no {MANIFEST}: it is missing or was never completed")
    manifest = Manifest.model_validate(json.loads(artifact.get_bytes(MANIFEST)))
    if kind and manifest.kind != kind:
        raise IncompleteArtifact(f"{artifact.uri} is a {manifest.kind!r} artifact, expected {kind!r}")
    return manifest


def fetch_verified(artifact: Artifact, manifest: Manifest, name: str, dest: Path) -> Path:
    """Download one file of an artifact and check it against the manifest's sha256."""
    return check_fetched(artifact, name, manifest.files.get(name), dest)


def check_fetched(artifact: Artifact, name: str, entry: FileEntry | None, dest: Path) -> Path:
    """Download one file of an artifact and check it against its listed sha256."""
    if entry is None:
        raise IncompleteArtifact(f"{artifact.uri}: {name!r} is not listed in its manifest")
    artifact.get_file(name, dest)
    if sha256_file(dest) != entry.sha256:
        raise IncompleteArtifact(f"{artifact.uri}/{name}: sha256 differs from the manifest (truncated or altered)")
    return dest

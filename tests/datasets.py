"""Small real conversation datasets for tests, written in the generator's artifact format."""
from __future__ import annotations

import json
from pathlib import Path

from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest
from eyas.store import Artifact, LocalStore
from eyas.target import BUNDLED, load_tokenizer, tokenizer_hash

CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris. It is known for the Eiffel Tower."),
    ("Give me a tip for sleeping better.", "Keep a regular schedule: go to bed and wake up at the same time."),
    ("Name three primary colors.", "The three primary colors are red, yellow and blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nwhispers to the sleeping town,\nmorning smells of earth."),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
]


def write_dataset(directory: Path, conversations=CONVERSATIONS, tok_hash: str | None = None) -> str:
    records = [{"id": f"t{i}", "source": "test",
                "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for i, (q, a) in enumerate(conversations)]
    return write_records(directory, records, tok_hash=tok_hash)


def write_records(directory: Path, records: list[dict], target: str = BUNDLED, tok_hash: str | None = None,
                  chat_template_kwargs: dict | None = None) -> str:
    """A dataset artifact of conversation records ({"id", "messages"}) generated for `target`."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = ArtifactWriter(Artifact(LocalStore(directory)))
    writer.put_bytes("conversations-00000.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    if tok_hash is None:
        tok_hash = tokenizer_hash(load_tokenizer(target))
    writer.commit(Manifest(kind="dataset", id="test", counts={"conversations": len(records)},
                           dataset=DatasetFacts(target=target, tokenizer_hash=tok_hash,
                                                chat_template_kwargs=chat_template_kwargs or {})))
    return str(directory)

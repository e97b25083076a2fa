"""Object keys: the only place that decides whether a key is allowed (no escaping its prefix)."""
from __future__ import annotations

import re

_SEGMENT = re.compile(r"^[A-Za-z0-9._=+-]+$")


class BadKey(ValueError):
    pass


def safe_key(*parts: str) -> str:
    """Join key parts with '/', refusing anything that could escape the prefix it is joined to."""
    segments: list[str] = []
    for part in parts:
        if part is None or part == "":
            continue
        if part.startswith("/") or "\\" in part:
            raise BadKey(f"object key {part!r} must be relative and use '/'")
        for seg in part.split("/"):
            if seg in ("", ".", ".."):
                raise BadKey(f"object key {part!r} has an empty, '.' or '..' segment")
            if not _SEGMENT.match(seg):
                raise BadKey(f"object key segment {seg!r} has characters outside [A-Za-z0-9._=+-]")
            segments.append(seg)
    if not segments:
        raise BadKey("empty object key")
    return "/".join(segments)

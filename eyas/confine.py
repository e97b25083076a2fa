"""What a job may name. Every spec field that names a file, an object or a URL is marked `Names` and goes through
`check_spec` — when the job is submitted (its `then` stages too) and again when a worker runs it:

  local paths  absolute, under an input root (Settings.input_roots; embedded mode adds the workdir), also after
               following '..' and symlinks; no '.', '..' or empty segments, no control characters
  s3://B/KEY   B is the configured bucket or one of Settings.allowed_buckets, KEY a key eyas.keys allows; never
               with credentials in it (the service's own are used, for its own buckets only)
  endpoints    http(s) base URLs from Settings.allowed_endpoints; no credentials, query or fragment in them (a key
               comes from Settings.endpoint_api_key), no control characters

A refusal (`Refused`) names the field and the rule, and reads the same whether or not the file exists: whether a
path may be read is decided from the string and where its symlinks lead, before anything is opened. A prompt file
that may be read has its first records checked (eyas.prompts.check_prompt_head: a few kB, never the whole file).

Each field's rule is also one regular expression (`Policy.pattern`), which the API schema carries; the check is
that same expression, plus what a schema cannot say (where symlinks lead, what a prompt file holds).
"""
from __future__ import annotations

import errno
import os
import re
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, StringConstraints

from eyas.prompts import PromptFileError, check_prompt_head
from eyas.settings import SERVICE_ENDPOINT, Settings

MAX_NAME = 4096  # characters in any path, URI or URL a spec names
SCHEMA_KEY = "x-eyas-names"  # where a marked field's JSON schema carries its Names (the API turns it into a pattern)

_CTRL = re.compile(r"[\x00-\x1f\x7f]")
# an object key segment (eyas.keys.safe_key): [A-Za-z0-9._=+-]+, but not '.' or '..'
_K, _KD = r"[A-Za-z0-9_=+-]", r"[A-Za-z0-9._=+-]"
_KEY_SEG = rf"(?:{_K}{_KD}*|\.{_K}{_KD}*|\.\.{_KD}+)"
# a local path segment: anything but '/' and control characters, and not '.' or '..'
_L, _LD = r"[^/.\x00-\x1f\x7f]", r"[^/\x00-\x1f\x7f]"
_PATH_SEG = rf"(?:{_L}{_LD}*|\.{_L}{_LD}*|\.\.{_LD}+)"
# a segment of a file:// URI as pathlib writes it (percent-encoded), not '.' or '..'
_U, _UD = r"(?:[A-Za-z0-9_~-]|%[0-9A-Fa-f]{2})", r"(?:[A-Za-z0-9._~-]|%[0-9A-Fa-f]{2})"
_URI_SEG = rf"(?:{_U}{_UD}*|\.{_U}{_UD}*|\.\.{_UD}+)"
_PORT = r"(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])"
_URL_PATH = r"(?:/[A-Za-z0-9._~!$&'()*+,;=:@%-]*)*"
_NOTHING = r"[^\s\S]"
# The end of the value in both Python's and ECMA-262's reading ('$' also matches before a final newline in Python).
_END = r"(?![\s\S])"

_OUTSIDE = ("local paths must lie under an input root (EYAS_INPUT_ROOTS), also after '..' and symlinks are "
            "followed")
_CREDENTIALS = "credentials in a URI are refused"


class Refused(ValueError):
    """A value a job may not name: `field` (dotted), `value` (credentials masked) and the `rule` it breaks."""

    def __init__(self, field: str, value: str, rule: str):
        super().__init__(f"{field}: {rule}")
        self.field, self.value, self.rule = field, value, rule


@dataclass(frozen=True)
class Names:
    """Marks a spec field that names something a job reads or sends requests to (use `names(...)`)."""

    what: Literal["prompts", "artifact", "target", "endpoint"]
    s3: bool = True  # may name an s3:// object (prompts) or prefix (artifacts)
    exact: tuple[str, ...] = ()  # values that name only what ships with Eyas ('bundled:mt_bench', 'auto')

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict[str, Any]:
        schema = handler(core_schema)
        schema[SCHEMA_KEY] = {"what": self.what, "s3": self.s3, "exact": list(self.exact)}
        return schema


def names(what: Literal["prompts", "artifact", "target", "endpoint"], exact: tuple[str, ...] = ()) -> Any:
    """The type of a field that names a file, object or URL: a string of at most MAX_NAME characters, checked
    by `check_spec` against the settings of the process that takes or runs the job (a target is never in S3)."""
    return Annotated[str, StringConstraints(max_length=MAX_NAME), Names(what, what != "target", exact)]


def _esc(text: str) -> str:
    """A literal in a pattern both Python and ECMA-262 (JSON schema) read alike (re.escape writes `\\-`, which
    ECMA's unicode mode refuses)."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)


def _local_alternative(root: str, directory: bool) -> str:
    tail = "/?" if directory else ""
    if root == "/":
        return rf"/(?:{_PATH_SEG}(?:/{_PATH_SEG})*{tail})?"
    return rf"{_esc(root)}(?:/{_PATH_SEG})*{tail}"


@dataclass(frozen=True)
class Policy:
    """The confinement a process applies, from its settings (`Policy.of`)."""

    roots: tuple[str, ...]  # absolute local roots, as configured and as resolved
    buckets: tuple[str, ...]
    endpoints: tuple[str, ...] | None  # None: any http(s) URL

    @classmethod
    def of(cls, settings: Settings) -> Policy:
        configured = list(settings.input_roots) + ([settings.workdir] if settings.mode == "embedded" else [])
        roots: list[str] = []
        for root in configured:
            for form in (os.path.abspath(root), os.path.realpath(root)):
                if form not in roots:
                    roots.append(form)
        endpoints = settings.allowed_endpoints
        if endpoints is None:
            endpoints = ["*"] if settings.mode == "embedded" else [SERVICE_ENDPOINT]
        for entry in endpoints:
            if entry != "*":
                _endpoint_alternative(entry)  # a malformed entry fails here, when the process starts
        return cls(roots=tuple(roots), buckets=settings.job_buckets,
                   endpoints=None if "*" in endpoints else tuple(endpoints))

    def pattern(self, marker: Names) -> str:
        """The one regular expression a value of a field marked `marker` must match (anchored at both ends)."""
        alternatives = [_esc(x) for x in marker.exact]
        if marker.what == "endpoint":
            alternatives += ([rf"https?://{_HOST}(?::{_PORT})?{_URL_PATH}"] if self.endpoints is None
                             else [_endpoint_alternative(e) for e in self.endpoints])
        else:
            if marker.s3:
                alternatives += [rf"s3://{_esc(b)}/{_KEY_SEG}(?:/{_KEY_SEG})*" for b in self.buckets]
            directory = marker.what != "prompts"
            alternatives += [_local_alternative(r, directory) for r in self.roots]
            if marker.what == "artifact":  # what a local store's artifact URIs look like (pathlib's as_uri)
                alternatives += [rf"{_esc(Path(r).as_uri())}(?:/{_URI_SEG})*/?" for r in self.roots]
        return rf"^(?:{'|'.join(alternatives) or _NOTHING}){_END}"

    def check(self, field: str, value: str, marker: Names) -> None:
        """Refuse `value` for `field` unless the policy allows it; a prompt file also has its head checked."""
        if _compiled(self.pattern(marker)).search(value) is None:
            rule = self._why(value, marker)
            raise Refused(field, masked(value), rule)
        if value in marker.exact or value.startswith("s3://") or marker.what == "endpoint":
            return
        path = Path(unquote(value[len("file://"):]) if value.startswith("file://") else value)
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in self.roots
                   if os.path.realpath(r) == r):
            raise Refused(field, value, _OUTSIDE)
        if marker.what == "prompts":
            try:
                check_prompt_head(Path(real))
            except FileNotFoundError:
                raise Refused(field, value, f"prompts file {value!r} does not exist") from None
            except PromptFileError as e:
                raise Refused(field, value, str(e)) from None
            except OSError as e:  # a directory, a name too long, an unreadable device …
                name = errno.errorcode.get(e.errno or 0, "error")
                raise Refused(field, value, f"prompts file cannot be read ({name}: {e.strerror})") from None

    def _why(self, value: str, marker: Names) -> str:
        """Which rule a value that does not match the pattern breaks (for the message only)."""
        if _CTRL.search(value):
            return "control characters (CR, LF, NUL …) are refused"
        if marker.what == "endpoint":
            return self._why_endpoint(value)
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", value)
        if value.lower().startswith("s3://"):
            authority = value[5:].split("/", 1)[0]
            if "@" in authority:
                return f"{_CREDENTIALS}: the service's own S3 credentials are used, for its own buckets only"
            if not marker.s3:
                return f"s3:// is not taken here; give {self._forms(marker)}"
            if not value.startswith("s3://"):
                return "the scheme is written s3://"
            if authority not in self.buckets:
                return (f"bucket {authority!r} is not allowed: {', '.join(self.buckets)} "
                        "(EYAS_S3_BUCKET, EYAS_ALLOWED_BUCKETS)")
            return "an object key is '/'-separated segments of [A-Za-z0-9._=+-], none empty, '.' or '..'"
        if value.startswith("file://") and marker.what == "artifact":
            value = unquote(value[len("file://"):])
        elif scheme:
            if marker.exact and value.split(":", 1)[0] in {x.split(":", 1)[0] for x in marker.exact if ":" in x}:
                return f"unknown name: give one of {', '.join(marker.exact)} or {self._forms(marker, exact=False)}"
            return f"{scheme.group(1)}: is not taken here; give {self._forms(marker)}"
        if not value.startswith("/"):
            return f"local paths must be absolute; give {self._forms(marker)}"
        if any(seg in ("", ".", "..") for seg in value.rstrip("/").split("/")[1:]):
            return "'.', '..' and empty path segments are refused"
        return _OUTSIDE

    def _why_endpoint(self, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme.lower() not in ("http", "https"):
            return "an endpoint is an http:// or https:// URL"
        if "@" in re.split(r"[/?#]", rest, maxsplit=1)[0]:
            return f"{_CREDENTIALS}: an endpoint's key comes from EYAS_ENDPOINT_API_KEY"
        if "?" in rest or "#" in rest:
            return "a query or fragment is refused in an endpoint (its key comes from EYAS_ENDPOINT_API_KEY)"
        if self.endpoints is None:
            return "an endpoint is scheme://host[:port][/path], the host a name or an IP address"
        return f"not an allowed endpoint: {', '.join(self.endpoints)} (EYAS_ALLOWED_ENDPOINTS)"

    def _forms(self, marker: Names, exact: bool = True) -> str:
        forms = list(marker.exact) if exact else []
        if marker.s3 and self.buckets:
            forms.append(f"s3://{self.buckets[0]}/KEY")
        forms.append("an absolute path under an input root" if self.roots else
                     "no local path (no input roots are configured)")
        return ", ".join(forms)


def _endpoint_alternative(entry: str) -> str:
    """The pattern of one allow-list entry, scheme://host[:port|:*][/path]: that base URL (with or without a
    trailing '/v1' and '/'), that host and port (any port for '*'; the scheme's default when none is given)."""
    m = re.fullmatch(r"(https?)://([^/:?#@\s]+|\[[0-9A-Fa-f:.]+\])(?::(\*|[0-9]{1,5}))?(/[^?#\s]*)?", entry)
    if m is None:
        raise ValueError(f"EYAS_ALLOWED_ENDPOINTS: {entry!r} is not scheme://host[:port|:*][/path]")
    scheme, host, port, path = m.group(1), m.group(2), m.group(3), (m.group(4) or "").rstrip("/")
    if port == "*":
        port_part = rf"(?::{_PORT})?"
    else:
        default = "80" if scheme == "http" else "443"
        port_part = f":{port}" if port and port != default else f"(?::{default})?"
    v1 = "" if path.endswith("/v1") else "(?:/v1)?"
    return f"{scheme}://{_esc(host)}{port_part}{_esc(path)}{v1}/?"


@lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def masked(value: str) -> str:
    """`value` with any userinfo of a URI in it masked (what is echoed or logged must not carry a secret either)."""
    return re.sub(r"(://)[^/?#@\s]*@", r"\1***@", value)


def redact(url: str | None) -> str | None:
    """A URL without userinfo, query or fragment: what may be written where others read it (manifests)."""
    if url is None:
        return None
    return re.split(r"[?#]", masked(url), maxsplit=1)[0].replace("***@", "")


def _marker(annotation: Any, metadata: Sequence[Any] = ()) -> Names | None:
    for m in metadata:
        if isinstance(m, Names):
            return m
    if typing.get_origin(annotation) is Annotated:
        return _marker(typing.get_args(annotation)[0], list(annotation.__metadata__))
    for arg in typing.get_args(annotation):
        found = _marker(arg)
        if found is not None:
            return found
    return None


def _models(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _models(arg)


def visit(model: type[BaseModel], data: Any, fn: Callable[[str, str, Names], str], where: str = "") -> None:
    """Call fn(field, value, marker) on every marked string in `data` (a spec as a dict, nested models and lists
    of them included) and put back what it returns."""
    if not isinstance(data, dict):
        return
    for name, info in model.model_fields.items():
        value = data.get(name)
        if value is None:
            continue
        marker = _marker(info.annotation, info.metadata)
        if marker is not None and isinstance(value, str):
            data[name] = fn(f"{where}{name}", value, marker)
        elif marker is not None and isinstance(value, list):  # a list of names (evaluate's compare_with)
            data[name] = [fn(f"{where}{name}.{i}", v, marker) if isinstance(v, str) else v
                          for i, v in enumerate(value)]
        for sub in _models(info.annotation):
            if isinstance(value, dict):
                visit(sub, value, fn, f"{where}{name}.")
            elif isinstance(value, list):
                for i, item in enumerate(value):
                    visit(sub, item, fn, f"{where}{name}.{i}.")


def check_spec(spec: BaseModel, settings: Settings, where: str = "") -> None:
    """Raise Refused for the first value in a parsed spec that names what this process's settings do not allow."""
    policy = Policy.of(settings)

    def check(field: str, value: str, marker: Names) -> str:
        policy.check(field, value, marker)
        return value

    visit(type(spec), spec.model_dump(), check, where)

"""What a recorded text loses before it is stored: e-mail addresses, key-like tokens and long digit runs (phone,
card and account numbers), then whatever the operator's own hook removes."""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable

_TOKEN = r"[A-Za-z0-9+/_-]"
DEFAULT_MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"), "[email]"),
    # vendors' key prefixes (OpenAI, Stripe, GitHub, Slack) even when the key is short
    (re.compile(r"\b(?:sk|pk|rk|ghp|gho|xox[abpr])[-_][A-Za-z0-9_-]{12,}"), "[key]"),
    (re.compile(r"\b[0-9a-fA-F]{32,}\b"), "[key]"),
    # base64-like runs of 32+ with a digit, a lower- and an upper-case letter: a secret, not a long word or path
    (re.compile(rf"(?<!{_TOKEN})(?=[A-Za-z0-9+/_-]*\d)(?=[A-Za-z0-9+/_-]*[a-z])(?=[A-Za-z0-9+/_-]*[A-Z])"
                rf"{_TOKEN}{{32,}}={{0,2}}"), "[key]"),
    # six digits or more, also written in groups ("4111 1111 1111 1111", "+1 555-123-4567")
    (re.compile(r"\d(?:[ .-]?\d){5,}"), "[number]"),
)


def mask_defaults(text: str) -> str:
    for pattern, mask in DEFAULT_MASKS:
        text = pattern.sub(mask, text)
    return text


def load_hook(spec: str) -> Callable[[str], str]:
    """The operator's function named `module:function`; a name that does not resolve stops the proxy at start."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"redact_hook {spec!r}: expected module:function")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"redact_hook {spec!r}: {name} is not a function of {module}")
    return fn


def make_redactor(default: bool, hook: str | None) -> Callable[[str], str]:
    steps = ([mask_defaults] if default else []) + ([load_hook(hook)] if hook else [])

    def redact(text: str) -> str:
        for step in steps:
            text = step(text)
        return text

    return redact

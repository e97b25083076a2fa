"""Near-duplicate detection for prompts: normalized word-bigram shingles, Jaccard similarity.

One function decides "the same prompt" everywhere: synthesis dedup, the held-out guard that keeps evaluation
prompts out of training data, and the evaluator's refusal to score on trained prompts.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_WORD = re.compile(r"[a-z0-9]+")
NEAR_DUP_THRESHOLD = 0.7


def normalize(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def shingles(text: str, n: int = 2) -> frozenset[str]:
    words = normalize(text).split()
    if len(words) < n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a or not b:
        return 1.0 if a == b else 0.0
    return len(a & b) / len(a | b)


class NearDupIndex:
    """Texts seen so far; `find(text)` returns the first one that equals or nearly equals `text`."""

    def __init__(self, texts: Iterable[str] = (), threshold: float = NEAR_DUP_THRESHOLD):
        self.threshold = threshold
        self._exact: dict[str, str] = {}
        self._shingles: list[tuple[frozenset[str], str]] = []
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        self._exact.setdefault(normalize(text), text)
        self._shingles.append((shingles(text), text))

    def find(self, text: str) -> str | None:
        hit = self._exact.get(normalize(text))
        if hit is not None:
            return hit
        s = shingles(text)
        for other, original in self._shingles:
            if jaccard(s, other) >= self.threshold:
                return original
        return None

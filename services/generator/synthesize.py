"""Prompt synthesis from the target itself (Magpie, 2024): give the model only the user-turn prefix of its own
chat template and sample; an aligned chat model writes a realistic user request and closes the turn.

Kept: requests that ended at the end-of-turn token, pass the length and language filters, and are not near
duplicates of each other (or of held-out evaluation prompts). Sampling settings are recorded with each prompt.
"""
from __future__ import annotations

import logging

from services.generator.dataset import Prompt
from services.generator.dedup import NearDupIndex
from services.generator.engine import Engine, SamplingParams

log = logging.getLogger(__name__)
_SENTINEL = "\x00EYAS-USER-TURN\x00"


def pre_query_text(tokenizer, system: str | None = None) -> str:
    """The chat template rendered up to where a user's words begin."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not render user content verbatim; cannot build a pre-query")
    return text[:cut]


def acceptable(text: str, min_chars: int = 12, max_chars: int = 2000, min_ascii: float = 0.9) -> str | None:
    """Why a candidate is rejected, or None if it is kept (length and a Latin-script language filter)."""
    if len(text) < min_chars:
        return "too_short"
    if len(text) > max_chars:
        return "too_long"
    if sum(c.isascii() for c in text) / len(text) < min_ascii:
        return "language"
    return None


async def synthesize_prompts(engine: Engine, tokenizer, n: int, seed: int = 0, held_out: list[str] = (),
                             sampling: SamplingParams | None = None, max_rounds: int = 4,
                             system: str | None = None) -> tuple[list[Prompt], dict[str, int]]:
    """Sample until `n` distinct acceptable requests are kept (or `max_rounds` rounds ran). Returns the prompts
    and the counts of what was dropped and why."""
    sampling = sampling or SamplingParams(temperature=1.0, top_p=0.95, max_tokens=128, seed=seed)
    prefix = pre_query_text(tokenizer, system)
    seen = NearDupIndex()
    guard = NearDupIndex(list(held_out))
    kept: list[Prompt] = []
    counts = {"sampled": 0, "kept": 0, "no_end_of_turn": 0, "too_short": 0, "too_long": 0, "language": 0,
              "near_duplicate": 0, "held_out": 0}
    for rnd in range(max_rounds):
        want = n - len(kept)
        if want <= 0:
            break
        batch = max(want + want // 2, 8)  # oversample: some candidates are filtered out
        params = sampling.model_copy(update={"seed": (sampling.seed or 0) + 1_000_003 * rnd})
        log.info("synthesis round %d: sampling %d candidate requests (%d kept so far)", rnd + 1, batch, len(kept))
        outs = await engine.complete_many([prefix] * batch, params)
        for i, c in enumerate(outs):
            counts["sampled"] += 1
            text = c.content.strip()
            if c.finish_reason != "stop":
                counts["no_end_of_turn"] += 1
                continue
            reason = acceptable(text)
            if reason is None and guard.find(text) is not None:
                reason = "held_out"
            if reason is None and seen.find(text) is not None:
                reason = "near_duplicate"
            if reason is not None:
                counts[reason] += 1
                continue
            seen.add(text)
            kept.append(Prompt(id=f"synth:{seed}:{rnd}:{i}", user_turns=[text], source="synth",
                               meta={"finish_reason": c.finish_reason,
                                     "sampling": params.model_dump(exclude={"chat_template_kwargs"})}))
            if len(kept) == n:
                break
    counts["kept"] = len(kept)
    log.info("synthesized %d prompts: %s", len(kept), counts)
    return kept, counts

"""Prompt synthesis from the target itself (Magpie, 2024): give the model only the user-turn prefix of its own
chat template and sample; an aligned chat model writes a realistic user request and closes the turn.

Steering (default: services.generator.task_mix): each candidate's user turn starts with an opener from a task mix
("Write a Python function that", "Solve", "You are a", …) and the target writes the rest, so the requests span
the tasks users bring instead of the small talk a small target samples on its own.

Kept: requests that ended at the end-of-turn token, pass the length and language filters, and are not near
duplicates of each other (or of held-out evaluation prompts). Sampling settings are recorded with each prompt.

Multi-turn (optional, Magpie's follow-ups): the target answers the request as the generator will (its sampling
settings), then samples the next user turn from the template's user prefix after that answer. The answers are
not kept; the generator regenerates every assistant turn.
"""
from __future__ import annotations

import itertools
import logging
import math

from eyas.deadline import Deadline, Pace
from eyas.neardup import NearDupIndex
from eyas.prompts import Prompt
from eyas.render import render_prompt_text
from services.generator.engine import Engine
from services.generator.spec import SamplingParams

log = logging.getLogger(__name__)
_SENTINEL = "\x00EYAS-USER-TURN\x00"


def pre_query_text(tokenizer, system: str | None = None, history: list[dict] = ()) -> str:
    """The chat template rendered up to where a user's words begin (after `history`, a conversation so far)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + list(history) + [
        {"role": "user", "content": _SENTINEL}]
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
                             sampling: SamplingParams | None = None, chunk: int = 8,
                             max_candidates: int | None = None, system: str | None = None, turns: int = 1,
                             answer_sampling: SamplingParams | None = None,
                             openers: list[str] = (), deadline: Deadline = Deadline(None),
                             ) -> tuple[list[Prompt], dict[str, int]]:
    """Sample candidates, at most `chunk` at a time, until `n` distinct acceptable requests are kept (or
    `max_candidates`, default 4n + 8, were drawn, or the next round would end after `deadline`: the first round
    is always drawn); then up to `turns - 1` follow-ups for each. Candidate i's
    request starts with openers[i % len(openers)] (none: free sampling; services.generator.task_mix). Returns the
    prompts and the counts of what was drawn, dropped and why."""
    sampling = sampling or SamplingParams(temperature=1.0, top_p=0.95, max_tokens=128, seed=seed)
    max_candidates = max_candidates or 4 * n + 8
    prefix = pre_query_text(tokenizer, system)
    seen = NearDupIndex()
    guard = NearDupIndex(list(held_out))
    kept: list[Prompt] = []
    counts = {"sampled": 0, "kept": 0, "no_end_of_turn": 0, "too_short": 0, "too_long": 0, "language": 0,
              "near_duplicate": 0, "held_out": 0}
    pace = Pace(deadline.clock)
    pace.mark()
    for rnd in itertools.count():
        if len(kept) >= n or counts["sampled"] >= max_candidates:
            break
        if pace.known and not deadline.fits(pace.seconds()):
            log.info("synthesis: stopped at its deadline with %d of %d prompts kept", len(kept), n)
            counts["stopped_at_deadline"] = 1
            break
        # size the last chunks by the acceptance seen so far: a batch costs its rows, so draw little beyond need
        accepted = len(kept) / counts["sampled"] if counts["sampled"] else 1.0
        needed = math.ceil((n - len(kept)) * 1.1 / max(accepted, 0.1))
        size = min(chunk, max_candidates - counts["sampled"], needed)
        params = sampling.model_copy(update={"seed": (sampling.seed or 0) + 1_000_003 * rnd})
        log.info("synthesis: sampling %d candidate requests (%d of %d kept so far)", size, len(kept), n)
        starts = [openers[(counts["sampled"] + i) % len(openers)] if openers else "" for i in range(size)]
        outs = await engine.complete_many([prefix + o for o in starts], params)
        pace.mark()
        counts["sampled"] += size
        for i, (start, c) in enumerate(zip(starts, outs, strict=True)):
            text = (start + c.content).strip()
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
                               meta={"finish_reason": c.finish_reason, "opener": start,
                                     "sampling": params.model_dump(exclude={"chat_template_kwargs"})}))
            if len(kept) == n:
                break
    counts["kept"] = len(kept)
    if turns > 1:
        counts.update(await _add_follow_ups(engine, tokenizer, kept, turns, sampling, answer_sampling or
                                            SamplingParams(max_tokens=256), guard, system))
    log.info("synthesized %d prompts: %s", len(kept), counts)
    return kept, counts


async def _add_follow_ups(engine: Engine, tokenizer, prompts: list[Prompt], turns: int, sampling: SamplingParams,
                          answer_sampling: SamplingParams, guard: NearDupIndex,
                          system: str | None) -> dict[str, int]:
    """Extend each prompt, turn by turn, with a follow-up request sampled after the target's answer. A prompt whose
    follow-up is rejected keeps the turns it has."""
    counts = {"follow_ups_kept": 0, "follow_up_no_end_of_turn": 0, "follow_up_too_short": 0,
              "follow_up_too_long": 0, "follow_up_language": 0, "follow_up_held_out": 0, "follow_up_repeat": 0}
    system_msgs = [{"role": "system", "content": system}] if system else []
    history = {p.id: [] for p in prompts}  # id → the conversation so far, answers included: [{"role", "content"}]
    for turn in range(2, turns + 1):
        growing = [p for p in prompts if len(p.user_turns) == turn - 1]
        if not growing:
            break
        for p in growing:
            history[p.id].append({"role": "user", "content": p.user_turns[-1]})
        answers = await engine.complete_many(
            [render_prompt_text(tokenizer, system_msgs + history[p.id], answer_sampling.chat_template_kwargs)
             for p in growing], answer_sampling)
        for p, a in zip(growing, answers, strict=True):
            history[p.id].append({"role": "assistant", "content": a.content.strip()})
        params = sampling.model_copy(update={"seed": (sampling.seed or 0) + 7_919 * turn})
        outs = await engine.complete_many([pre_query_text(tokenizer, system, history[p.id]) for p in growing], params)
        for p, c in zip(growing, outs, strict=True):
            text = c.content.strip()
            reason = "no_end_of_turn" if c.finish_reason != "stop" else acceptable(text)
            if reason is None and guard.find(text) is not None:
                reason = "held_out"
            if reason is None and NearDupIndex(p.user_turns).find(text) is not None:
                reason = "repeat"  # the user asking the same thing again teaches nothing new
            if reason is not None:
                counts[f"follow_up_{reason}"] += 1
                continue
            p.user_turns.append(text)
            p.meta["answer_sampling"] = answer_sampling.model_dump(exclude={"chat_template_kwargs"})
            counts["follow_ups_kept"] += 1
    return counts

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

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class SynthesisConfig:
    """How a Synthesizer draws: `seed` (each round's, and its prompts' names), `held_out` texts no prompt may
    near-duplicate, candidates' `sampling` (default: temperature 1, top-p 0.95, 128 tokens), rounds of `chunk`,
    at most `max_candidates` (default 4n + 8), the `system` prompt, `turns` per prompt (follow-ups sampled after
    the target's answers, drawn with `answer_sampling`), and the `openers` requests start with."""

    seed: int = 0
    held_out: Sequence[str] = ()
    sampling: SamplingParams | None = None
    chunk: int = 8
    max_candidates: int | None = None
    system: str | None = None
    turns: int = 1
    answer_sampling: SamplingParams | None = None
    openers: Sequence[str] = ()


class Synthesizer:
    """Draws prompts from the target in rounds of at most `chunk` candidates, `n` in all (or until `max_candidates`,
    default 4n + 8, were drawn), and hands them out `take()` by `take()`; the state across takes (the near-duplicate
    index, the round numbers that seed each round and name its prompts, the counts) is what lets a job answer each
    take before drawing the next. `known`: user turns of prompts already handed out (a resumed job's), `counts`:
    theirs. Candidate i's request starts with openers[i % len(openers)] (none: free sampling;
    services.generator.task_mix)."""

    def __init__(self, engine: Engine, tokenizer, n: int, config: SynthesisConfig = SynthesisConfig(),
                 known: list[str] = (), counts: dict[str, int] | None = None):
        seed = config.seed
        self.engine, self.tokenizer, self.n, self.seed, self.chunk = engine, tokenizer, n, seed, config.chunk
        self.sampling = config.sampling or SamplingParams(temperature=1.0, top_p=0.95, max_tokens=128, seed=seed)
        self.max_candidates = config.max_candidates or 4 * n + 8
        self.system, self.turns, self.openers = config.system, config.turns, list(config.openers)
        self.answer_sampling = config.answer_sampling or SamplingParams(max_tokens=256)
        self.prefix = pre_query_text(tokenizer, config.system)
        self.seen = NearDupIndex(list(known))
        self.guard = NearDupIndex(list(config.held_out))
        self.counts = {"sampled": 0, "kept": 0, "rounds": 0, "no_end_of_turn": 0, "too_short": 0, "too_long": 0,
                       "language": 0, "near_duplicate": 0, "held_out": 0, **(counts or {})}
        self.surplus: list[Prompt] = []  # kept by a round but beyond what its take asked for: the next take's first
        self.pace = Pace()  # seconds per round of candidates
        self.stopped = False  # a round would have ended after its take's deadline

    def _exhausted(self) -> bool:
        return self.counts["kept"] + len(self.surplus) >= self.n or self.counts["sampled"] >= self.max_candidates

    async def take(self, want: int, deadline: Deadline = Deadline(None)) -> list[Prompt]:
        """Up to `want` more prompts (each with its follow-ups where turns > 1): rounds are drawn until they are
        kept, the `n` are reached, or the next round would end after `deadline` (the first round is drawn unless the
        deadline has passed); the surplus of earlier rounds is handed out either way."""
        while len(self.surplus) < want and not self._exhausted():
            if (self.pace.known or deadline.left() <= 0) and not deadline.fits(self.pace.seconds()):
                log.info("synthesis: stopped at its deadline with %d of %d prompts kept",
                         self.counts["kept"] + len(self.surplus), self.n)
                self.stopped = True
                break
            await self._draw_round()
        kept, self.surplus = self.surplus[:want], self.surplus[want:]
        self.counts["kept"] += len(kept)
        if self.turns > 1 and kept:
            counts = await _add_follow_ups(self.engine, self.tokenizer, kept, self.turns, self.sampling,
                                           self.answer_sampling, self.guard, self.system)
            for k, v in counts.items():
                self.counts[k] = self.counts.get(k, 0) + v
        return kept

    async def _draw_round(self) -> None:
        """One round of candidates: sized by the acceptance seen so far near the end (a batch costs its rows, so
        draw little beyond need), its acceptable requests onto the surplus."""
        counts, rnd = self.counts, self.counts["rounds"]
        have = counts["kept"] + len(self.surplus)
        accepted = have / counts["sampled"] if counts["sampled"] else 1.0
        needed = math.ceil((self.n - have) * 1.1 / max(accepted, 0.1))
        size = min(self.chunk, self.max_candidates - counts["sampled"], needed)
        params = self.sampling.model_copy(update={"seed": (self.sampling.seed or 0) + 1_000_003 * rnd})
        log.info("synthesis: sampling %d candidate requests (%d of %d kept so far)", size, have, self.n)
        starts = [self.openers[(counts["sampled"] + i) % len(self.openers)] if self.openers else ""
                  for i in range(size)]
        t0 = time.monotonic()
        outs = await self.engine.complete_many([self.prefix + o for o in starts], params)
        self.pace.add(time.monotonic() - t0)  # the round's own time (a job may answer a take between rounds)
        counts["sampled"] += size
        counts["rounds"] += 1
        for i, (start, c) in enumerate(zip(starts, outs, strict=True)):
            text = (start + c.content).strip()
            reason = "no_end_of_turn" if c.finish_reason != "stop" else acceptable(text)
            if reason is None and self.guard.find(text) is not None:
                reason = "held_out"
            if reason is None and self.seen.find(text) is not None:
                reason = "near_duplicate"
            if reason is not None:
                counts[reason] += 1
                continue
            self.seen.add(text)
            self.surplus.append(Prompt(id=f"synth:{self.seed}:{rnd}:{i}", user_turns=[text], source="synth",
                                       meta={"finish_reason": c.finish_reason, "opener": start,
                                             "sampling": params.model_dump(exclude={"chat_template_kwargs"})}))
            if counts["kept"] + len(self.surplus) == self.n:
                break


async def synthesize_prompts(engine: Engine, tokenizer, n: int, config: SynthesisConfig = SynthesisConfig(),
                             deadline: Deadline = Deadline(None)) -> tuple[list[Prompt], dict[str, int]]:
    """`n` distinct acceptable requests at once (a Synthesizer's one take; fewer when its candidates or
    `deadline` run out), and the counts of what was drawn, dropped and why."""
    synth = Synthesizer(engine, tokenizer, n, config)
    kept = await synth.take(n, deadline)
    counts = {**synth.counts, **({"stopped_at_deadline": 1} if synth.stopped else {})}
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

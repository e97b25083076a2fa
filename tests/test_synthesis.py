"""Prompt synthesis (Magpie-style, from the bundled target), dedup, the held-out guard and weighted mixes."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import pytest

from eyas.deadline import Deadline
from eyas.neardup import NearDupIndex
from eyas.prompts import bundled_prompt_file, load_prompts
from eyas.settings import Settings
from eyas.target import BUNDLED, load_tokenizer
from services.generator.engine import Completion, InProcessEngine
from services.generator.gather import gather_prompts, prompt_batches
from services.generator.spec import SamplingParams, Spec
from services.generator.synthesize import SynthesisConfig, Synthesizer, pre_query_text, synthesize_prompts
from services.generator.task_mix import TASK_OPENERS, task_openers


@pytest.fixture(scope="module")
def engine():
    return InProcessEngine(BUNDLED, max_batch=8)


def test_pre_query_is_the_template_up_to_the_user_words():
    text = pre_query_text(load_tokenizer(BUNDLED))
    assert text.endswith("<|im_start|>user\n")
    assert "<|im_start|>system" in text  # SmolLM2's template adds its default system prompt


def test_synthesis_is_reproducible_distinct_and_ends_at_end_of_turn(engine):
    tok = engine.tok
    a, counts = asyncio.run(synthesize_prompts(engine, tok, 3, SynthesisConfig(seed=7)))
    b, _ = asyncio.run(synthesize_prompts(engine, tok, 3, SynthesisConfig(seed=7)))
    texts = [p.user_turns[0] for p in a]
    assert texts == [p.user_turns[0] for p in b]  # same seed → same prompts
    assert len(a) == 3 and all(t.strip() for t in texts)
    assert len({t.lower() for t in texts}) == 3
    assert all(p.meta["finish_reason"] == "stop" for p in a)  # the model closed the user turn itself
    assert counts["kept"] == 3 and counts["sampled"] >= 3
    c, _ = asyncio.run(synthesize_prompts(engine, tok, 3, SynthesisConfig(seed=8)))
    assert [p.user_turns[0] for p in c] != texts


TOPICS = ("bread lighthouse tax violin glacier python mortgage sonnet tomato rocket marathon chess orchid "
          "volcano budget sushi quantum fossil jazz kayak saffron comet ledger tundra opera cactus bicycle "
          "nebula pottery falcon").split()


class _Scripted:
    """An engine whose every other candidate runs to the token cap (the unit test of the drawing logic only)."""

    def __init__(self):
        self.calls: list[int] = []
        self.drawn = 0

    async def complete_many(self, texts, params):
        self.calls.append(len(texts))
        out = []
        for _ in texts:
            self.drawn += 1
            words = random.Random(self.drawn).sample(TOPICS, 6)  # distinct requests, never near-duplicates
            out.append(Completion(content=" ".join(words) + "?", reasoning_content=None,
                                  finish_reason="length" if self.drawn % 2 else "stop", prompt_tokens=1,
                                  completion_tokens=1))
        return out


def test_synthesis_draws_in_chunks_sized_to_what_is_still_needed():
    fake = _Scripted()
    kept, counts = asyncio.run(synthesize_prompts(fake, load_tokenizer(BUNDLED), 10, SynthesisConfig(chunk=8)))
    assert len(kept) == 10 and counts["near_duplicate"] == 0
    assert max(fake.calls) <= 8  # never more than a chunk at once
    # half are rejected: after the first chunk the draws follow the measured acceptance, not the 1.5x guess
    assert fake.calls == [8, 8, 5] and counts["sampled"] == 21
    capped, _ = asyncio.run(synthesize_prompts(_Scripted(), load_tokenizer(BUNDLED), 10,
                                                      SynthesisConfig(chunk=8, max_candidates=12)))
    assert len(capped) == 6  # 12 candidates at most, half of them usable


def _batches(spec: Spec, saved=None, answer_s=lambda: 0.0, stop_after: int = 100):
    async def collect():
        out = []
        async for got, counts in prompt_batches(spec, _Scripted(), load_tokenizer(BUNDLED), Settings(), saved,
                                                answer_s):
            out.append((got, dict(counts)))
            if len(out) == stop_after:
                break
        return out

    return asyncio.run(collect())


def test_a_take_past_its_deadline_hands_out_the_surplus_and_draws_nothing():
    fake, tok = _Scripted(), load_tokenizer(BUNDLED)
    synth = Synthesizer(fake, tok, 100, SynthesisConfig(chunk=8))
    assert len(asyncio.run(synth.take(3))) == 3 and fake.calls == [8]  # a round keeps 4: one left over
    past = Deadline(time.time() - 1)
    assert [p.id for p in asyncio.run(synth.take(3, past))] == ["synth:0:0:7"] and fake.calls == [8]
    assert asyncio.run(synth.take(3, past)) == [] and fake.calls == [8]
    # not even a first round
    assert asyncio.run(Synthesizer(_Scripted(), tok, 100, SynthesisConfig(chunk=8)).take(3, past)) == []


def test_a_synthesizing_job_with_a_deadline_gets_its_prompts_a_batch_at_a_time():
    spec = Spec(synthesize=20, concurrency=8, held_out=None, finish_by=time.time() + 3600)
    got = _batches(spec)
    assert [len(b) for b, _ in got] == [8, 8, 4]  # a batch each (the scripted engine keeps half of each round)
    ids = [p.id for b, _ in got for p in b]
    assert len(set(ids)) == 20
    assert got[-1][1]["synth_kept"] == got[-1][1]["source:synth"] == 20
    # the surplus of a round is the next batch's start: 8-candidate rounds, 4 kept each, so 2 rounds a batch
    assert [c["synth_rounds"] for _, c in got] == [2, 4, 5]
    # resumed after the first batch: the saved prompts first, then new ones after them (new ids, the counts go on)
    first, counts = got[0]
    resumed = _batches(spec, {"prompts": [dataclasses.asdict(p) for p in first], "counts": counts})
    assert resumed[0][0] == first and sum(len(b) for b, _ in resumed) == 20
    assert not {p.id for b, _ in resumed[1:] for p in b} & {p.id for p in first}
    # no batch is drawn whose answers would end after the deadline: here the first batch's took 3,600 s
    answered = iter([0.0])  # (no answers yet when the first batch is drawn)
    assert [len(b) for b, _ in _batches(spec, answer_s=lambda: next(answered, 3600.0))] == [8]
    # without a deadline (or with prompt files, or a mix) the prompts come all at once, as before
    assert [len(b) for b, _ in _batches(Spec(synthesize=20, concurrency=8, held_out=None))] == [20]


class _Recording(_Scripted):
    """The scripted engine, keeping the texts it was asked to continue."""

    def __init__(self):
        super().__init__()
        self.texts: list[str] = []

    async def complete_many(self, texts, params):
        self.texts += texts
        return await super().complete_many(texts, params)


def test_openers_start_the_requests_in_turn():
    fake, tok = _Recording(), load_tokenizer(BUNDLED)
    openers = ["Write a Python function that", "Solve", ""]
    kept, _ = asyncio.run(synthesize_prompts(fake, tok, 4, SynthesisConfig(chunk=8, openers=openers)))
    prefix = pre_query_text(tok)
    assert fake.texts[:4] == [prefix + o for o in openers + openers[:1]]  # candidate i gets openers[i % 3]
    # the scripted engine ends the turn of candidates 1, 3, 5, 7 only: their openers, in order, are kept
    assert [p.meta["opener"] for p in kept] == ["Solve", "Write a Python function that", "", "Solve"]
    assert all(p.user_turns[0].startswith(p.meta["opener"]) for p in kept)  # the request begins with it


def test_task_mix_spans_every_category_within_one_round():
    openers = task_openers()
    assert set(openers[: len(TASK_OPENERS)]) == {group[0] for group in TASK_OPENERS.values()}
    assert sorted(openers) == sorted(o for group in TASK_OPENERS.values() for o in group)
    assert Spec(synthesize=8).synth_openers is None  # the default: the task mix (gather_prompts)


def test_the_target_continues_an_opener_into_a_request(engine):
    kept, counts = asyncio.run(synthesize_prompts(engine, engine.tok, 2,
                                                    SynthesisConfig(seed=3, openers=["Write a poem about"])))
    assert len(kept) == 2 and counts["kept"] == 2
    for p in kept:
        assert p.user_turns[0].startswith("Write a poem about ") and len(p.user_turns[0]) > len("Write a poem about ")


def test_follow_ups_continue_the_conversation_reproducibly(engine):
    tok = engine.tok
    answers = SamplingParams(max_tokens=48)  # greedy, as the generator answers by default

    def run(seed):
        return asyncio.run(synthesize_prompts(engine, tok, 3,
                                              SynthesisConfig(seed=seed, turns=2, answer_sampling=answers)))

    a, counts = run(7)
    b, _ = run(7)
    assert [p.user_turns for p in a] == [p.user_turns for p in b]  # same seed → same conversations
    grown = [p for p in a if len(p.user_turns) == 2]
    assert counts["follow_ups_kept"] == len(grown) >= 2  # 135M closes most follow-ups; a rejected one is counted
    assert sum(v for k, v in counts.items() if k.startswith("follow_up_")) == 3 - len(grown)
    for p in grown:
        assert p.user_turns[1].strip() and p.user_turns[1] != p.user_turns[0]
        assert p.meta["answer_sampling"]["max_tokens"] == 48
    # the follow-up was sampled after the answer: the prefix holds the first turn and an assistant turn
    prefix = pre_query_text(tok, None, [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}])
    assert prefix.endswith("<|im_start|>user\n") and prefix.index("Hi?") < prefix.index("Hello.")


def test_near_duplicates_are_found():
    idx = NearDupIndex(["How do I bake sourdough bread at home with a simple starter?"])
    # exact after normalizing
    assert idx.find("how do i bake sourdough bread at home, with a simple starter") is not None
    assert idx.find("How do I bake sourdough bread at home with a very simple starter?") is not None  # near
    assert idx.find("What is the tallest mountain in Europe?") is None


def test_held_out_guard_drops_evaluation_prompts(tmp_path, engine):
    mt = load_prompts(bundled_prompt_file("mt_bench"))
    f = tmp_path / "train.jsonl"
    rows = [{"id": "copy", "messages": [{"role": "user", "content": mt[0].user_turns[0]}]},
            {"id": "near", "messages": [{"role": "user", "content": mt[1].user_turns[0] + " Thanks!"}]},
            {"id": "fine", "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, counts = asyncio.run(gather_prompts(Spec(prompts=str(f)), engine, engine.tok, Settings()))
    assert [p.id for p in prompts] == ["train:fine"]
    assert counts["held_out_dropped"] == 2


def test_mix_keeps_weights_and_sources(tmp_path, engine):
    files = []
    for name in ("a", "b"):
        f = tmp_path / f"{name}.jsonl"
        f.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"{name} question {i}"}]})
                             + "\n" for i in range(20)))
        files.append(str(f))
    spec = Spec(mix=[{"prompts": files[0], "weight": 3}, {"prompts": files[1], "weight": 1}], limit=12)
    prompts, counts = asyncio.run(gather_prompts(spec, engine, engine.tok, Settings()))
    by_source = [p.source for p in prompts]
    assert by_source.count("a") == 9 and by_source.count("b") == 3
    assert counts[f"source:{files[0]}"] == 9


def test_spec_needs_a_source():
    with pytest.raises(ValueError, match="give prompts"):
        Spec()
    with pytest.raises(ValueError, match="needs limit"):
        Spec(mix=[{"prompts": "synth"}])

"""In-process decoding (services.generator.engine.InProcessEngine, eyas.decoding) beside transformers' `generate`
on the same left-padded batches of the bundled target: greedy tokens/s, the ratio, and whether the answers are the
same; then top-p sampling (synthesis's settings), tokens/s only.

    .venv/bin/python bench/decode.py --batches 48 96 --max-tokens 96

The prompts are chat requests of mixed length (a few words to a paragraph), as synthesized prompts are: a batch's
padding up to its longest prompt is part of what is measured.
"""
from __future__ import annotations

import argparse
import time

import torch

from eyas.target import BUNDLED
from services.generator.engine import InProcessEngine
from services.generator.spec import SamplingParams

TOPICS = ("rivers", "prime numbers", "a job interview", "sorting a list in Python", "the French revolution",
          "a birthday poem", "photosynthesis", "saving money", "a haunted lighthouse", "SQL joins")


def requests(n: int) -> list[str]:
    """n chat requests whose lengths spread from one line to a paragraph."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Please be specific, give an example, and explain each step of your reasoning." * (i % 5)
        out.append(f"Tell me about {topic} (request {i}).{detail}")
    return out


def plain_generate(engine: InProcessEngine, texts: list[str], params: SamplingParams) -> list[list[int]]:
    """transformers' `generate` on the same left-padded batch: the plain alternative."""
    tok, model = engine.tok, engine.target.model
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sample = params.temperature > 0
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=params.max_tokens, do_sample=sample,
                             temperature=params.temperature if sample else None,
                             top_p=params.top_p if sample else None, top_k=None,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        rows.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[48, 96])
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    engine = InProcessEngine(BUNDLED, max_batch=max(args.batches))
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=0.95, seed=0)
    engine.generate_texts([engine.render([{"role": "user", "content": "Hi"}], greedy)] * 2,
                          greedy.model_copy(update={"max_tokens": 2}))  # warm-up
    print(f"{'batch':>5} {'mode':<8} {'eyas tok/s':>10} {'generate tok/s':>14} {'ratio':>6}  same answers")
    for batch in args.batches:
        texts = [engine.render([{"role": "user", "content": r}], greedy) for r in requests(batch)]
        for mode, params in (("greedy", greedy), ("top-p", sampled)):
            t0 = time.perf_counter()
            ours = engine.generate_texts(texts, params)
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            theirs = plain_generate(engine, texts, params)
            theirs_s = time.perf_counter() - t0
            ours_rate = sum(c.completion_tokens for c in ours) / ours_s
            theirs_rate = sum(len(r) for r in theirs) / theirs_s
            equal = sum(c.content == engine.tok.decode(r, skip_special_tokens=True)
                        for c, r in zip(ours, theirs, strict=True))
            same = f"{equal}/{batch}" if mode == "greedy" else "(sampled)"
            print(f"{batch:>5} {mode:<8} {ours_rate:>10.0f} {theirs_rate:>14.0f} "
                  f"{ours_rate / theirs_rate:>6.2f}  {same}", flush=True)


if __name__ == "__main__":
    main()

"""The job's prompts from every source (prompt files, synthesis, weighted mixes), with held-out evaluation prompts
dropped and counted; for a job that only synthesizes, to a deadline, in batches each answered before the next is
drawn."""
from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable

from eyas.deadline import Deadline
from eyas.neardup import NearDupIndex
from eyas.prompts import Prompt, load_prompt_source
from eyas.settings import Settings
from services.generator.engine import Engine
from services.generator.spec import Spec
from services.generator.synthesize import SynthesisConfig, Synthesizer, synthesize_prompts
from services.generator.task_mix import task_openers

log = logging.getLogger(__name__)


def quotas(weights: list[float], total: int) -> list[int]:
    """Split `total` by weight (largest remainder), so a mix keeps its weights to within one prompt."""
    raw = [total * w / sum(weights) for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: total - sum(out)]:
        out[i] += 1
    return out


def _held_out(spec: Spec, settings: Settings) -> list[str]:
    return [t for p in load_prompt_source(spec.held_out, settings) for t in p.user_turns] if spec.held_out else []


def _synthesis(spec: Spec, held: list[str]) -> SynthesisConfig:
    """How the spec synthesizes: the Synthesizer's (and synthesize_prompts') settings beside the engine and count."""
    return SynthesisConfig(seed=spec.synth_seed, held_out=held, chunk=spec.concurrency, turns=spec.synth_turns,
                           answer_sampling=spec.sampling,
                           openers=task_openers() if spec.synth_openers is None else spec.synth_openers)


def in_batches(spec: Spec) -> bool:
    """Whether the job's prompts come a batch at a time: a job that only synthesizes, to a deadline. Each batch is
    answered before the next is drawn, so a slow spell costs a batch, not the answers to every prompt synthesized
    first (a hog on the answers left most of a run's synthesized prompts unanswered:
    bench/README.md § Measured defaults)."""
    return bool(spec.finish_by and spec.synthesize and not spec.prompts and not spec.mix)


async def prompt_batches(spec: Spec, engine: Engine, tokenizer, settings: Settings, saved: dict | None,
                         answer_s: Callable[[], float]) -> AsyncIterator[tuple[list[Prompt], dict[str, int]]]:
    """The job's prompts as (new prompts, the counts of all so far): those `saved` by an earlier run of the job
    first; then, all at once (gather_prompts), or, where `in_batches`, a batch of `spec.concurrency` at a time: a
    round of candidates is drawn only while it and `answer_s()` (seconds of a batch's answers that must fit for them
    to start, 0 before the first) still end by the deadline; what earlier rounds kept beyond their batch is handed
    out even when no round fits (the generator answers it while it may start)."""
    counts: dict[str, int] = dict(saved["counts"]) if saved else {}
    known = [Prompt(**p) for p in saved["prompts"]] if saved else []
    if saved:
        yield known, counts
    if not in_batches(spec):
        if not saved:
            yield await gather_prompts(spec, engine, tokenizer, settings)
        return
    held = _held_out(spec, settings)
    synth_counts = {k.removeprefix("synth_"): v for k, v in counts.items() if k.startswith("synth_")}
    synth = Synthesizer(engine, tokenizer, spec.synthesize, _synthesis(spec, held),
                        known=[t for p in known for t in p.user_turns], counts=synth_counts)
    while True:
        finish_by = min(spec.synthesize_by or math.inf, spec.finish_by - answer_s())
        got = await synth.take(spec.concurrency, Deadline(finish_by))
        if not got:
            return
        log.info("synthesized %d prompts (%d so far): %s", len(got), synth.counts["kept"], synth.counts)
        counts.update({f"synth_{k}": v for k, v in synth.counts.items()},
                      held_out_dropped=synth.counts["held_out"], drawn_batches=counts.get("drawn_batches", 0) + 1,
                      **{"source:synth": synth.counts["kept"]})
        yield got, counts


async def gather_prompts(spec: Spec, engine: Engine, tokenizer,
                         settings: Settings) -> tuple[list[Prompt], dict[str, int]]:
    """The job's prompts from every source, with held-out (evaluation) prompts dropped and counted."""
    held = _held_out(spec, settings)
    guard = NearDupIndex(held)
    counts: dict[str, int] = {"held_out_dropped": 0}
    if spec.mix:
        sources = list(zip([m.prompts for m in spec.mix], quotas([m.weight for m in spec.mix], spec.limit),
                           strict=True))
    else:
        sources = ([(spec.prompts, spec.limit)] if spec.prompts else []) + (
            [("synth", spec.synthesize)] if spec.synthesize else [])
    prompts: list[Prompt] = []
    for source, quota in sources:
        if source == "synth":
            got, synth_counts = await synthesize_prompts(engine, tokenizer, quota, _synthesis(spec, held),
                                                         deadline=Deadline(spec.synthesize_by or spec.finish_by))
            counts.update({f"synth_{k}": v for k, v in synth_counts.items()})
            counts["held_out_dropped"] += synth_counts["held_out"]
        else:
            got = []
            for p in load_prompt_source(source, settings):
                if any(guard.find(t) is not None for t in p.user_turns):
                    counts["held_out_dropped"] += 1
                    continue
                got.append(p)
            got = got[:quota] if quota else got
        counts[f"source:{source}"] = len(got)
        prompts += got
    return prompts, counts

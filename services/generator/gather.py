"""The job's prompts from every source (prompt files, synthesis, weighted mixes), with held-out evaluation prompts
dropped and counted."""
from __future__ import annotations

from eyas.deadline import Deadline
from eyas.neardup import NearDupIndex
from eyas.prompts import Prompt, load_prompt_source
from eyas.settings import Settings
from services.generator.engine import Engine
from services.generator.spec import Spec
from services.generator.synthesize import synthesize_prompts
from services.generator.task_mix import task_openers


def quotas(weights: list[float], total: int) -> list[int]:
    """Split `total` by weight (largest remainder), so a mix keeps its weights to within one prompt."""
    raw = [total * w / sum(weights) for w in weights]
    out = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: total - sum(out)]:
        out[i] += 1
    return out


async def gather_prompts(spec: Spec, engine: Engine, tokenizer,
                         settings: Settings) -> tuple[list[Prompt], dict[str, int]]:
    """The job's prompts from every source, with held-out (evaluation) prompts dropped and counted."""
    held = [t for p in load_prompt_source(spec.held_out, settings) for t in p.user_turns] if spec.held_out else []
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
            got, synth_counts = await synthesize_prompts(engine, tokenizer, quota, seed=spec.synth_seed,
                                                         held_out=held, chunk=spec.concurrency,
                                                         turns=spec.synth_turns,
                                                         answer_sampling=spec.sampling,
                                                         openers=task_openers() if spec.synth_openers is None
                                                         else spec.synth_openers,
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

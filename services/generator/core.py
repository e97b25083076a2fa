"""Generator stage: regenerate every assistant turn of a prompt set with the target (through an OpenAI-compatible
endpoint, or in-process for the embedded default), and store conversations as JSONL shards + manifest.

Each assistant turn is conditioned on the regenerated history; the system prompt is kept. Records keep
reasoning_content beside content (both are what the drafter learns), finish_reason and usage per turn, and the
sampling parameters and chat-template kwargs used.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

from eyas.datasets import DEAD_LETTER_FILE, PROMPTS_FILE, saved_prompts, shard_name
from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest
from eyas.prompts import Prompt
from eyas.stage import StageContext, StageResult
from eyas.target import load_tokenizer, tokenizer_hash
from services.generator.engine import Engine, HttpEngine, InProcessEngine
from services.generator.gather import gather_prompts
from services.generator.generate import Generator
from services.generator.journal import Journal
from services.generator.probe import check_endpoint
from services.generator.spec import Spec
from services.generator.limit import LocalLimit, SharedLimit
from services.generator.server_load import ServerLoad
from services.generator.throttle import Throttle
from services.generator.workshare import LocalWork, SharedWork, Work

log = logging.getLogger(__name__)
INPUT_FIELD = "prompts"


def _make_engine(spec: Spec, settings) -> Engine:
    if spec.endpoint is None:
        return InProcessEngine(spec.target, max_batch=spec.concurrency)
    key = settings.endpoint_api_key  # from the settings: a spec never carries a credential (eyas.confine)
    return HttpEngine(spec.endpoint, spec.model or "target", api_key=key.get_secret_value() if key else None,
                      max_connections=spec.concurrency, timeout_s=spec.request_timeout_s)


def _make_throttle(spec: Spec, settings) -> Throttle:
    # this process's share: the job's concurrency, capped by what one worker may keep in flight
    most = min(spec.concurrency, settings.worker_max_in_flight)
    if spec.endpoint is None:  # in-process: the engine batches whatever is in flight
        return Throttle(LocalLimit(most, initial=most), most)
    start = spec.initial_concurrency or 4
    if settings.mode == "service":  # one limit per endpoint, grown and cut by every worker, under the job's maximum
        limit = SharedLimit(settings.redis_url, spec.endpoint, spec.concurrency, initial=start)
    else:
        limit = LocalLimit(most, initial=start)
    return Throttle(limit, most, latency_factor=spec.latency_factor, load=ServerLoad(spec.endpoint))


async def _generate(spec: Spec, ctx: StageContext, engine: Engine, prompts: dict[str, Prompt], work: Work,
                    journal: Journal, already: int, coordinator: bool) -> dict[str, int]:
    throttle = _make_throttle(spec, ctx.settings)
    try:
        gen = Generator(spec, engine, throttle, journal, ctx)
        await gen.run(prompts, work, already, coordinator)
        return gen.stats
    finally:
        await throttle.aclose()


def _share_work(spec: Spec, ctx: StageContext, pending: list[str]) -> Work:
    """Service mode: publish the pending prompts for every generator worker and ask for helpers."""
    if ctx.recruit is None or spec.max_workers == 1 or len(pending) < 2:
        return LocalWork(pending)
    work = SharedWork(ctx.settings.redis_url, ctx.job_id, ctx.attempt, ctx.settings.visibility_timeout_s)
    work.publish(pending)
    ctx.recruit(min(spec.max_workers - 1, len(pending) - 1))
    return work


def run(spec: Spec, ctx: StageContext) -> StageResult:
    """The job's own task (the coordinator): resolve the prompts, generate them (with helpers in service mode),
    and fold the journal into the final shards."""
    tokenizer = load_tokenizer(spec.target)
    tok_hash = tokenizer_hash(tokenizer)
    journal = Journal(ctx.output, flush_every=spec.checkpoint_every)

    async def main():
        engine = _make_engine(spec, ctx.settings)
        try:
            if isinstance(engine, HttpEngine):  # before the first request: the endpoint must serve the target
                ctx.metrics.update(await check_endpoint(engine, tokenizer, spec.target,
                                                        spec.sampling.chat_template_kwargs))
            if ctx.output.exists(PROMPTS_FILE):  # resume: the same prompts, not a fresh synthesis
                saved = saved_prompts(ctx.output)
                prompts, source_counts = [Prompt(**p) for p in saved["prompts"]], saved["counts"]
            else:
                prompts, source_counts = await gather_prompts(spec, engine, tokenizer, ctx.settings)
                ctx.output.put_bytes(PROMPTS_FILE, json.dumps(
                    {"prompts": [dataclasses.asdict(p) for p in prompts], "counts": source_counts}).encode())
            done = journal.load()
            if done:
                log.info("resuming: %d of %d prompts already finished", len(done), len(prompts))
            pending = {p.id: p for p in prompts if p.id not in done}
            work = _share_work(spec, ctx, list(pending))
            journal.on_commit = work.finished
            try:
                stats = await _generate(spec, ctx, engine, pending, work, journal, len(done), coordinator=True)
                shared = work.shared_stats()  # what the helpers counted
            finally:
                work.retire()
            return prompts, source_counts, stats, shared, len(pending), set(done)
        finally:
            await engine.aclose()

    t0 = time.monotonic()
    prompts, source_counts, stats, shared, pending, resumed = asyncio.run(main())
    elapsed = time.monotonic() - t0
    results = journal.load()  # every participant's samples
    dead = journal.load_dead()
    failures = [dead[p.id] for p in prompts if p.id in dead and p.id not in results]
    records = [results[p.id] for p in prompts if p.id in results]  # prompt order, each id once
    lost = len(prompts) - len(records) - len(failures)
    if lost:  # cannot happen while the journal and the shared work keep their promises; never commit a gap
        raise RuntimeError(f"{lost} prompts were neither generated nor dead-lettered")
    writer = ArtifactWriter(ctx.output)
    writer.put_bytes(PROMPTS_FILE, ctx.output.get_bytes(PROMPTS_FILE))  # same bytes; now hashed in the manifest
    with tempfile.TemporaryDirectory(prefix="eyas-gen-") as tmp:
        for i in range(0, len(records), spec.shard_size):
            path = Path(tmp) / shard_name(i // spec.shard_size)
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[i:i + spec.shard_size]))
            writer.put_file(path.name, path)
        if failures:
            path = Path(tmp) / DEAD_LETTER_FILE
            path.write_text("".join(json.dumps(f) + "\n" for f in failures))
            writer.put_file(path.name, path)
    completion_tokens = sum(t["completion_tokens"] for r in records for t in r["turns"])
    # Counted from the records, not from what each participant reported (a helper reports after its last commit,
    # which may be after the coordinator finished): this run's tokens are those of the prompts not resumed.
    new_tokens = sum(t["completion_tokens"] for r in records if r["id"] not in resumed for t in r["turns"])
    # resumed (finished by an earlier run of the job) + this run's (own + helped) = every prompt
    metrics = {"completed": len(records), "failed": len(failures),
               "retried": stats["retried"] + shared.get("retried", 0),
               "completion_tokens": completion_tokens, "seconds": round(elapsed, 1),
               "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1), "resumed": len(resumed),
               "helped": pending - stats["completed"] - stats["failed"]}  # prompts other workers generated
    ctx.progress(len(records) + len(failures), len(prompts), "prompts", force=True)
    writer.commit(Manifest(
        kind="dataset", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
        inputs=[s for s in ([spec.prompts] + [m.prompts for m in spec.mix]) if s],
        counts={"prompts": len(prompts), "conversations": len(records), "failed": len(failures),
                "completion_tokens": completion_tokens, **source_counts},
        dataset=DatasetFacts(target=spec.target, tokenizer_hash=tok_hash, endpoint=spec.endpoint,
                             chat_template_kwargs=spec.sampling.chat_template_kwargs), metrics=metrics,
    ))
    ctx.output.store.delete_prefix(ctx.output.key("parts"))  # the journal is folded into the shards
    log.info("generated %d conversations (%d failed), %d tokens at %.1f tok/s → %s", len(records), len(failures),
             completion_tokens, metrics["tokens_per_s"], ctx.output.uri)
    return StageResult(output_uri=ctx.output.uri, metrics=metrics)


def assist(spec: Spec, ctx: StageContext) -> None:
    """A helper task (service mode): join the job's shared work until nothing is left to claim. Its samples go
    to the job's journal; the coordinator commits the artifact."""
    work = SharedWork(ctx.settings.redis_url, ctx.job_id, ctx.attempt, ctx.settings.visibility_timeout_s)
    try:
        if work.open_count() == 0 or not ctx.output.exists(PROMPTS_FILE):
            return  # all claimed or finished already
        prompts = {p["id"]: Prompt(**p) for p in saved_prompts(ctx.output)["prompts"]}
        journal = Journal(ctx.output, flush_every=spec.checkpoint_every, on_commit=work.finished)

        async def main() -> dict[str, int]:
            engine = _make_engine(spec, ctx.settings)
            try:
                return await _generate(spec, ctx, engine, prompts, work, journal, 0, coordinator=False)
            finally:
                await engine.aclose()

        stats = asyncio.run(main())
        work.add_stats({"retried": stats["retried"], "completion_tokens": stats["completion_tokens"]})
        log.info("helped job %s: %d prompts generated, %d dead-lettered", ctx.job_id, stats["completed"],
                 stats["failed"])
    finally:
        work.close()

"""Generator stage: regenerate every assistant turn of a prompt set with the target (through an OpenAI-compatible
endpoint, or in-process where no endpoint is given), and store conversations as JSONL shards + manifest.

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
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from eyas.coordination import LocalLimit, Work
from eyas.datasets import DEAD_LETTER_FILE, PROMPTS_FILE, saved_prompts, shard_name
from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest
from eyas.prompts import Prompt
from eyas.stage import StageContext, StageResult
from eyas.target import load_tokenizer, tokenizer_hash
from services.generator.endpoint_check import check_endpoint
from services.generator.engine import Engine, HttpEngine, InProcessEngine
from services.generator.gather import prompt_batches
from services.generator.generate import Generator
from services.generator.journal import Journal
from services.generator.server_load import ServerLoad
from services.generator.spec import Spec
from services.generator.throttle import Throttle, initial_limit

log = logging.getLogger(__name__)
INPUT_FIELD = "prompts"
CANCEL_POLL_S = 0.2  # how often a run's event loop looks for a cancel (StageContext.stop)
T = TypeVar("T")


def _make_engine(spec: Spec, ctx: StageContext) -> Engine:
    if spec.endpoint is None:  # stops a batch in flight at its next decoding step once the job is cancelled
        return InProcessEngine(spec.target, max_batch=spec.concurrency, check=ctx.check)
    settings = ctx.settings
    key = settings.endpoint_api_key  # from the settings: a spec never carries a credential (eyas.confine)
    return HttpEngine(spec.endpoint, spec.model or "target", api_key=key.get_secret_value() if key else None,
                      max_connections=spec.concurrency, timeout_s=spec.request_timeout_s)


def _make_throttle(spec: Spec, ctx: StageContext) -> Throttle:
    # this process's share: the job's concurrency, capped by what one worker may keep in flight
    most = _most_in_flight(spec, ctx)
    if spec.endpoint is None:  # in-process: the engine batches whatever is in flight
        return Throttle(LocalLimit(most, initial=most), most)
    # the endpoint's limit, grown and cut by every process the deployment shares it with, under the job's maximum
    limit = ctx.limit(spec.endpoint, spec.concurrency, spec.initial_concurrency or initial_limit(spec.concurrency))
    return Throttle(limit, most, latency_factor=spec.latency_factor, load=ServerLoad(spec.endpoint))


def _most_in_flight(spec: Spec, ctx: StageContext) -> int:
    return min(spec.concurrency, ctx.settings.worker_max_in_flight)


async def _generate(spec: Spec, ctx: StageContext, engine: Engine, prompts: dict[str, Prompt], work: Work,
                    journal: Journal, already: int, owner: bool) -> dict[str, int]:
    """A helper's share of a job: the prompts `work` hands out."""
    throttle = _make_throttle(spec, ctx)
    try:
        gen = Generator(spec, engine, throttle, journal, ctx)
        await gen.run(prompts, work, already, owner)
        return gen.stats
    finally:
        await throttle.aclose()


async def _until_cancelled(ctx: StageContext, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, looking for a cancel every CANCEL_POLL_S: on one, `work` is cancelled (requests in flight are
    let go, samples finished so far journaled; the in-process engine's batch stops at its next step) and Cancelled
    raised."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=CANCEL_POLL_S))[0]:
        if ctx.stop.is_set():
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: the cancel is what the run reports
            ctx.check()
    return task.result()


def _share_work(spec: Spec, ctx: StageContext, pending: list[str]) -> Work:
    """The pending prompts, shared with other generator workers where the deployment has them and one process
    cannot keep them all in flight."""
    most = _most_in_flight(spec, ctx)
    helpers = spec.max_workers - 1 if len(pending) > most else 0
    return ctx.share(pending, helpers, most)


@dataclasses.dataclass
class _Generated:
    """What a run's generation did: the prompts handed out, in order, and their sources' counts; the owner's
    own stats and the helpers' (`shared`); how many prompts this run had pending, and those an earlier run of the
    job finished (`resumed`)."""

    resumed: set[str]
    prompts: list[Prompt] = dataclasses.field(default_factory=list)
    source_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    shared: dict[str, int] = dataclasses.field(default_factory=dict)
    pending: int = 0


async def _run_as_owner(spec: Spec, ctx: StageContext, tokenizer: Any, journal: Journal) -> _Generated:
    """Generate the job's prompts, a batch at a time, until they are done or the deadline stops them."""
    engine = _make_engine(spec, ctx)
    try:
        if isinstance(engine, HttpEngine):  # before the first request: the endpoint must serve the target
            ctx.metrics.update(await check_endpoint(engine, tokenizer, spec.target,
                                                    spec.sampling.chat_template_kwargs))
        # resume: the same prompts, not a fresh synthesis (and, where they come in batches, more after them)
        saved = saved_prompts(ctx.output) if ctx.output.exists(PROMPTS_FILE) else None
        done = journal.load()
        if done:  # (a job's prompts are saved before any is handed out, so `saved` is there)
            log.info("resuming: %d of %d prompts already finished", len(done), len(saved["prompts"]))
        throttle = _make_throttle(spec, ctx)
        gen = Generator(spec, engine, throttle, journal, ctx)
        out = _Generated(resumed=set(done))
        batches = prompt_batches(spec, engine, tokenizer, ctx.settings, saved, gen.must_fit_s)
        try:
            async for got, source_counts in batches:
                out.source_counts = source_counts
                await _generate_batch(spec, ctx, gen, got, out)
                if gen.stopped_at_deadline:
                    break
        finally:
            await batches.aclose()
            await throttle.aclose()
        out.stats = {**gen.stats, "stopped_at_deadline": int(gen.stopped_at_deadline)}
        return out
    finally:
        await engine.aclose()


async def _generate_batch(spec: Spec, ctx: StageContext, gen: Generator, got: list[Prompt], out: _Generated) -> None:
    """One batch of prompts: saved with those before it, then those not finished yet generated (with helpers where
    the deployment shares the work)."""
    out.prompts += got
    ctx.output.put_bytes(PROMPTS_FILE, json.dumps(  # before they are handed out: resumable
        {"prompts": [dataclasses.asdict(p) for p in out.prompts], "counts": out.source_counts}).encode())
    pending = {p.id: p for p in got if p.id not in out.resumed}
    out.pending += len(pending)
    work = _share_work(spec, ctx, list(pending))
    gen.journal.on_commit = work.finished
    try:
        await gen.run(pending, work, len(out.prompts) - len(pending), owner=True)
        for k, v in work.shared_stats().items():  # what the helpers counted
            out.shared[k] = out.shared.get(k, 0) + v
    finally:
        work.close()


def run(spec: Spec, ctx: StageContext) -> StageResult:
    """The job's own task (the owner): resolve the prompts, generate them (with helpers where the deployment
    shares the work), and fold the journal into the final shards."""
    tokenizer = load_tokenizer(spec.target)
    journal = Journal(ctx.output, flush_every=spec.checkpoint_every)
    t0 = time.monotonic()
    out = asyncio.run(_until_cancelled(ctx, _run_as_owner(spec, ctx, tokenizer, journal)))
    elapsed = time.monotonic() - t0
    results = journal.load()  # every participant's samples
    dead = journal.load_dead()
    failures = [dead[p.id] for p in out.prompts if p.id in dead and p.id not in results]
    records = [results[p.id] for p in out.prompts if p.id in results]  # prompt order, each id once
    # prompts nobody started before the deadline (none without one: the journal and the shared work keep their
    # promises, and a gap is never committed)
    unreached = len(out.prompts) - len(records) - len(failures)
    if unreached and not out.stats["stopped_at_deadline"]:
        raise RuntimeError(f"{unreached} prompts were neither generated nor dead-lettered")
    if not out.prompts:  # synthesis kept none before its deadline: say so, not a missing prompt file further down
        raise RuntimeError(f"no prompt was synthesized before the deadline ({elapsed:.0f} s, {out.stats}): give the "
                           "job more time (eyas run --minutes) or a prompt file")
    writer = ArtifactWriter(ctx.output)
    writer.put_bytes(PROMPTS_FILE, ctx.output.get_bytes(PROMPTS_FILE))  # same bytes; now hashed in the manifest
    _write_shards(writer, records, failures, spec.shard_size)
    metrics = _metrics(out, records, failures, elapsed)
    ctx.progress(len(records) + len(failures), len(out.prompts), "prompts", force=True)
    writer.commit(Manifest(
        kind="dataset", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
        inputs=[s for s in ([spec.prompts] + [m.prompts for m in spec.mix]) if s],
        counts={"prompts": len(out.prompts), "conversations": len(records), "failed": len(failures),
                "unreached": unreached, "completion_tokens": metrics["completion_tokens"], **out.source_counts},
        dataset=DatasetFacts(target=spec.target, tokenizer_hash=tokenizer_hash(tokenizer), endpoint=spec.endpoint,
                             chat_template_kwargs=spec.sampling.chat_template_kwargs), metrics=metrics,
    ))
    ctx.output.store.delete_prefix(ctx.output.key("parts"))  # the journal is folded into the shards
    log.info("generated %d conversations (%d failed), %d tokens at %.1f tok/s → %s", len(records), len(failures),
             metrics["completion_tokens"], metrics["tokens_per_s"], ctx.output.uri)
    return StageResult(output_uri=ctx.output.uri, metrics=metrics)


def _write_shards(writer: ArtifactWriter, records: list[dict], failures: list[dict], shard_size: int) -> None:
    """The conversations as JSONL shards of `shard_size`, and the dead letters beside them."""
    with tempfile.TemporaryDirectory(prefix="eyas-gen-") as tmp:
        for i in range(0, len(records), shard_size):
            path = Path(tmp) / shard_name(i // shard_size)
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[i:i + shard_size]))
            writer.put_file(path.name, path)
        if failures:
            path = Path(tmp) / DEAD_LETTER_FILE
            path.write_text("".join(json.dumps(f) + "\n" for f in failures))
            writer.put_file(path.name, path)


def _metrics(out: _Generated, records: list[dict], failures: list[dict], elapsed: float) -> dict[str, Any]:
    """The job's metrics: resumed (finished by an earlier run of the job) + this run's (own + helped) = every
    prompt."""
    unreached = len(out.prompts) - len(records) - len(failures)
    completion_tokens = sum(t["completion_tokens"] for r in records for t in r["turns"])
    # Counted from the records, not from what each participant reported (a helper reports after its last commit,
    # which may be after the owner finished): this run's tokens are those of the prompts not resumed.
    new_tokens = sum(t["completion_tokens"] for r in records if r["id"] not in out.resumed for t in r["turns"])
    return {"completed": len(records), "failed": len(failures),
            "retried": out.stats["retried"] + out.shared.get("retried", 0),
            "completion_tokens": completion_tokens, "seconds": round(elapsed, 1),
            "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1), "resumed": len(out.resumed),
            "unreached": unreached,
            # prompts other workers generated
            "helped": out.pending - out.stats["completed"] - out.stats["failed"] - unreached}


def assist(spec: Spec, ctx: StageContext, work: Work) -> None:
    """A helper: generate the prompts `work` hands out (a share of a running job's). Its samples go to the job's
    journal; the job's own run commits the artifact."""
    if not ctx.output.exists(PROMPTS_FILE):
        return
    prompts = {p["id"]: Prompt(**p) for p in saved_prompts(ctx.output)["prompts"]}
    journal = Journal(ctx.output, flush_every=spec.checkpoint_every, on_commit=work.finished)

    async def main() -> dict[str, int]:
        engine = _make_engine(spec, ctx)
        try:
            return await _generate(spec, ctx, engine, prompts, work, journal, 0, owner=False)
        finally:
            await engine.aclose()

    stats = asyncio.run(_until_cancelled(ctx, main()))
    work.add_stats({"retried": stats["retried"], "completion_tokens": stats["completion_tokens"]})
    log.info("helped job %s: %d prompts generated, %d dead-lettered", ctx.job_id, stats["completed"],
             stats["failed"])

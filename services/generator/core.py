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
import uuid
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from eyas.manifest import ArtifactWriter, Manifest
from eyas.settings import Settings
from eyas.store import Artifact, open_artifact
from eyas.stages import StageContext, StageResult, StageSpec
from eyas.target import BUNDLED, load_tokenizer, tokenizer_hash
from services.generator.dataset import Prompt, PromptFileError, bundled_prompt_file, load_prompts
from services.generator.dedup import NearDupIndex
from services.generator.synthesize import synthesize_prompts
from services.generator.engine import (
    Completion,
    Engine,
    EngineError,
    HttpEngine,
    InProcessEngine,
    SamplingParams,
)
from services.generator.throttle import AimdState, GlobalLeases, Throttle
from services.generator.workshare import LocalWork, SharedWork, Work

log = logging.getLogger(__name__)
INPUT_FIELD = "prompts"


def resolve_prompt_file(prompts: str) -> Path:
    if prompts.startswith("bundled:"):
        name = prompts.split(":", 1)[1]
        if name not in ("sharegpt", "mt_bench"):
            raise PromptFileError(f"unknown bundled prompt set {name!r} (bundled:sharegpt or bundled:mt_bench)")
        return bundled_prompt_file(name)
    return Path(prompts)


class MixSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompts: str = Field(description="'synth' (synthesized from the target) or a prompt file / bundled:NAME")
    weight: float = Field(1.0, gt=0)

    @field_validator("prompts")
    @classmethod
    def _readable(_cls, v: str) -> str:
        return v if v == "synth" else _check_prompt_file(v)


def _check_prompt_file(v: str) -> str:
    if v.startswith(("s3://", "pending")):
        return v
    load_prompts(resolve_prompt_file(v), limit=1)  # raises PromptFileError naming the record and field
    return v


class Spec(StageSpec):
    prompts: str | None = Field(None, description="prompt file (messages-JSONL, ShareGPT, MT-bench), bundled:sharegpt")
    synthesize: int = Field(0, ge=0, le=1_000_000, description="also synthesize N prompts from the target (Magpie)")
    synth_seed: int = Field(0, description="seed for prompt synthesis (reproducible)")
    synth_turns: int = Field(1, ge=1, le=8, description="user turns per synthesized prompt: each follow-up is "
                             "sampled after the target's answer to the turn before (Magpie multi-turn)")
    mix: list[MixSource] = Field([], description="weighted sources instead of prompts/synthesize; needs limit")
    held_out: str | None = Field("bundled:mt_bench", description="evaluation prompts kept out of training data")
    endpoint: str | None = Field(None, description="OpenAI-compatible base URL; none = in-process target")
    model: str | None = Field(None, description="served model name at the endpoint (default: the target)")
    target: str = Field(BUNDLED, description="the target whose chat template the data is for")
    sampling: SamplingParams = SamplingParams()
    concurrency: int = Field(16, ge=1, le=4096)
    limit: int | None = Field(None, ge=1, description="use the first N prompts")
    max_turns: int | None = Field(None, ge=1, description="regenerate at most this many assistant turns")
    shard_size: int = Field(1000, ge=1)
    initial_concurrency: int | None = Field(None, ge=1, description="AIMD start (default min(4, concurrency))")
    max_attempts: int = Field(6, ge=1, le=100, description="tries per request before the dead-letter file")
    request_timeout_s: float | None = Field(None, gt=0, description="read timeout (default sized to max_tokens)")
    checkpoint_every: int = Field(8, ge=1, description="finished samples per journal part (resume granularity)")
    max_workers: int = Field(8, ge=1, le=256, description="service mode: most generator workers that share this "
                             "job (its own and the helpers it asks the generate queue for); 1 = its own only")

    @field_validator("prompts", "held_out")
    @classmethod
    def _prompts_readable(_cls, v: str | None) -> str | None:
        return v if v is None else _check_prompt_file(v)

    @model_validator(mode="after")
    def _has_source(self):
        if not (self.prompts or self.synthesize or self.mix):
            raise ValueError("give prompts, synthesize > 0, or mix")
        if self.mix and (self.prompts or self.synthesize):
            raise ValueError("mix replaces prompts/synthesize; give one or the other")
        if self.mix and not self.limit:
            raise ValueError("a mix needs limit (the total number of prompts to split by weight)")
        return self

    @field_validator("endpoint")
    @classmethod
    def _endpoint_http(_cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("endpoint must be an http(s):// URL")
        return v


RETRY_STATUS = frozenset({408, 409, 425, 429})


def _retryable(e: BaseException) -> bool:
    """Timeouts, connection errors, malformed responses, 408/409/425/429 and 5xx; never other 4xx."""
    return isinstance(e, EngineError) and (e.status is None or e.status in RETRY_STATUS or e.status >= 500)


def _wait(state: RetryCallState) -> float:
    """Exponential backoff with jitter, but never sooner than the server's Retry-After."""
    backoff = wait_exponential_jitter(multiplier=0.5, max=30.0, jitter=0.5)(state)
    exc = state.outcome.exception() if state.outcome else None
    return max(backoff, getattr(exc, "retry_after", None) or 0.0)


class DeadLetter(Exception):
    def __init__(self, prompt_id: str, reason: str, attempts: int):
        super().__init__(reason)
        self.record = {"id": prompt_id, "error": reason, "attempts": attempts}


class Journal:
    """Finished samples, committed in small atomic parts under the output prefix: the source of resume and of the
    final shards (every worker sharing a job journals here). A rerun (or a redelivered task) reads them and
    regenerates none; kill -9 loses only unflushed samples, which are regenerated, so nothing is lost and nothing
    is written twice into the final shards. Dead letters are committed at once, in parts of their own.
    `on_commit(ids)` is told which prompts each commit made durable."""

    def __init__(self, artifact: Artifact, flush_every: int = 8, flush_s: float = 5.0,
                 on_commit: Callable[[list[str]], None] = lambda ids: None):
        self.artifact, self.flush_every, self.flush_s, self.on_commit = artifact, flush_every, flush_s, on_commit
        self.buffer: list[dict] = []
        self._last = time.monotonic()

    def _read(self, prefix: str) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for name in sorted(n for n in self.artifact.names() if n.startswith(prefix)):
            for line in self.artifact.get_bytes(name).decode().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    out.setdefault(rec["id"], rec)
        return out

    def load(self) -> dict[str, dict]:
        """Finished samples by prompt id (the first journaled, if a prompt was ever generated twice)."""
        return self._read("parts/part-")

    def load_dead(self) -> dict[str, dict]:
        return self._read("parts/dead-")

    def add_dead(self, record: dict) -> None:
        self.artifact.put_bytes(f"parts/dead-{time.time_ns()}-{uuid.uuid4().hex[:6]}.jsonl",
                                (json.dumps(record) + "\n").encode())
        self.on_commit([record["id"]])

    def add(self, record: dict) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.flush_every or time.monotonic() - self._last > self.flush_s:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.buffer).encode()
            self.artifact.put_bytes(f"parts/part-{time.time_ns()}-{uuid.uuid4().hex[:6]}.jsonl", body)
            ids = [r["id"] for r in self.buffer]
            self.buffer = []
            self.on_commit(ids)
        self._last = time.monotonic()


class Generator:
    """Regenerates a prompt set through an engine: throttled (AIMD within a global maximum), retried, journaled."""

    def __init__(self, spec: Spec, engine: Engine, throttle: Throttle, journal: Journal, ctx: StageContext):
        self.spec, self.engine, self.throttle, self.journal, self.ctx = spec, engine, throttle, journal, ctx
        self.stats = {"completed": 0, "failed": 0, "retried": 0, "completion_tokens": 0}
        self._t0 = time.monotonic()

    async def _turn(self, prompt_id: str, messages: list[dict]) -> Completion:
        attempts = 0
        try:
            async for attempt in AsyncRetrying(stop=stop_after_attempt(self.spec.max_attempts), wait=_wait,
                                               retry=retry_if_exception(_retryable), reraise=True):
                with attempt:
                    attempts += 1
                    if attempts > 1:
                        self.stats["retried"] += 1
                    async with self.throttle.slot():
                        try:
                            c = await self.engine.chat(messages, self.spec.sampling)
                        except EngineError as e:
                            if _retryable(e):  # overload or a failing server: back off
                                await self.throttle.congestion()
                            raise
                    await self.throttle.success(c.latency_s)
                    return c
        except EngineError as e:
            raise DeadLetter(prompt_id, str(e), attempts) from e
        raise AssertionError("unreachable")

    async def converse(self, prompt: Prompt) -> dict:
        """Each assistant turn is conditioned on the regenerated history; the system prompt is kept."""
        messages: list[dict] = [{"role": "system", "content": prompt.system}] if prompt.system else []
        turns = []
        for user in prompt.user_turns[: self.spec.max_turns]:
            messages.append({"role": "user", "content": user})
            c = await self._turn(prompt.id, [{"role": m["role"], "content": m["content"]} for m in messages])
            reply = {"role": "assistant", "content": c.content}
            if c.reasoning_content:
                reply["reasoning_content"] = c.reasoning_content
            messages.append(reply)
            turns.append({"finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                          "completion_tokens": c.completion_tokens, "latency_s": round(c.latency_s, 3)})
        return {"id": prompt.id, "source": prompt.source, "messages": messages, "turns": turns,
                "sampling": self.spec.sampling.model_dump(exclude={"chat_template_kwargs"}),
                "chat_template_kwargs": self.spec.sampling.chat_template_kwargs,
                **({"meta": prompt.meta} if prompt.meta else {})}

    def _report(self, work: Work, total: int, already: int) -> None:
        """The coordinator's view on the job record: every participant's finished prompts, its own rates."""
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        self.ctx.metrics.update(**self.stats, in_flight=self.throttle.in_flight,
                                concurrency=round(self.throttle.aimd.limit, 2),
                                tokens_per_s=round(self.stats["completion_tokens"] / elapsed, 1))
        own = self.stats["completed"] + self.stats["failed"]
        self.ctx.progress(already + max(own, work.finished_count()), total, "prompts")

    async def run(self, prompts: dict[str, Prompt], work: Work, already: int = 0, coordinator: bool = True) -> None:
        """Generate the prompts `work` hands out, journaling each; `already` were finished before. The coordinator
        also waits until no prompt is open anywhere (taking over the claims of participants that died)."""
        from tqdm.asyncio import tqdm

        total = already + len(prompts) if coordinator else len(prompts)
        bar = tqdm(total=total, initial=already, desc="generate", unit="prompt")

        async def worker():
            while True:
                prompt_id = work.claim()
                if prompt_id is None:
                    self.journal.flush()  # commit (and so release) what this process holds before waiting
                    if not coordinator or work.open_count() == 0:
                        return
                    await asyncio.sleep(0.5)  # others hold claims: wait, and take over any that lapse
                    self._report(work, total, already)
                    continue
                try:
                    rec = await self.converse(prompts[prompt_id])
                except DeadLetter as e:
                    self.journal.add_dead(e.record)
                    self.stats["failed"] += 1
                else:
                    self.journal.add(rec)
                    self.stats["completed"] += 1
                    self.stats["completion_tokens"] += sum(t["completion_tokens"] for t in rec["turns"])
                bar.update(1)
                if coordinator:
                    self._report(work, total, already)

        # one task per possible slot; the throttle decides how many are in flight
        await asyncio.gather(*(worker() for _ in range(max(1, min(self.throttle.aimd.maximum, len(prompts))))))
        self.journal.flush()
        bar.close()


def _load_file(uri: str, settings: Settings) -> list[Prompt]:
    if uri.startswith("s3://"):
        bucket_uri, _, name = uri.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="eyas-prompts-") as tmp:
            # keep the object's file name: prompt ids derive from it and must not change between runs
            open_artifact(bucket_uri, settings).get_file(name, Path(tmp) / name)
            return load_prompts(Path(tmp) / name)
    return load_prompts(resolve_prompt_file(uri))


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
    held = [t for p in _load_file(spec.held_out, settings) for t in p.user_turns] if spec.held_out else []
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
                                                         answer_sampling=spec.sampling)
            counts.update({f"synth_{k}": v for k, v in synth_counts.items()})
            counts["held_out_dropped"] += synth_counts["held_out"]
        else:
            got = []
            for p in _load_file(source, settings):
                if any(guard.find(t) is not None for t in p.user_turns):
                    counts["held_out_dropped"] += 1
                    continue
                got.append(p)
            got = got[:quota] if quota else got
        counts[f"source:{source}"] = len(got)
        prompts += got
    return prompts, counts


PROMPTS_FILE = "prompts.jsonl"  # the job's resolved prompt list, fixed at the first run (resume reuses it)


def _make_engine(spec: Spec) -> Engine:
    return (HttpEngine(spec.endpoint, spec.model or "target", max_connections=spec.concurrency,
                       timeout_s=spec.request_timeout_s)
            if spec.endpoint else InProcessEngine(spec.target, max_batch=spec.concurrency))


def _make_throttle(spec: Spec, settings) -> Throttle:
    # this process's share: the job's concurrency, capped by what one worker may keep in flight
    most = min(spec.concurrency, settings.worker_max_in_flight)
    if spec.endpoint is None:  # in-process: the engine batches whatever is in flight
        return Throttle(AimdState(limit=most, maximum=most))
    leases = None
    if settings.mode == "service":  # every worker shares one maximum (the job's concurrency) per endpoint
        leases = GlobalLeases(settings.redis_url, spec.endpoint, spec.concurrency)
    start = min(spec.initial_concurrency or 4, most)
    return Throttle(AimdState(limit=start, maximum=most), leases)


async def _generate(spec: Spec, ctx: StageContext, engine: Engine, prompts: dict[str, Prompt], work: Work,
                    journal: Journal, already: int, coordinator: bool) -> dict[str, int]:
    throttle = _make_throttle(spec, ctx.settings)
    try:
        gen = Generator(spec, engine, throttle, journal, ctx)
        await gen.run(prompts, work, already, coordinator)
        return gen.stats
    finally:
        if throttle.leases is not None:
            await throttle.leases.aclose()


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
        engine = _make_engine(spec)
        try:
            if ctx.output.exists(PROMPTS_FILE):  # resume: the same prompts, not a fresh synthesis
                saved = json.loads(ctx.output.get_bytes(PROMPTS_FILE))
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
            return prompts, source_counts, stats, shared, len(pending)
        finally:
            await engine.aclose()

    t0 = time.monotonic()
    prompts, source_counts, stats, shared, pending = asyncio.run(main())
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
            path = Path(tmp) / f"conversations-{i // spec.shard_size:05d}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[i:i + spec.shard_size]))
            writer.put_file(path.name, path)
        if failures:
            path = Path(tmp) / "dead-letter.jsonl"
            path.write_text("".join(json.dumps(f) + "\n" for f in failures))
            writer.put_file(path.name, path)
    completion_tokens = sum(t["completion_tokens"] for r in records for t in r["turns"])
    new_tokens = stats["completion_tokens"] + shared.get("completion_tokens", 0)  # generated in this run
    metrics = {"completed": len(records), "failed": len(failures),
               "retried": stats["retried"] + shared.get("retried", 0),
               "completion_tokens": completion_tokens, "seconds": round(elapsed, 1),
               "tokens_per_s": round(new_tokens / max(elapsed, 1e-9), 1),
               "helped": pending - stats["completed"] - stats["failed"]}  # prompts other workers generated
    writer.commit(Manifest(
        kind="dataset", id=ctx.job_id, job_spec=spec.model_dump(mode="json"),
        inputs=[s for s in ([spec.prompts] + [m.prompts for m in spec.mix]) if s],
        counts={"prompts": len(prompts), "conversations": len(records), "failed": len(failures),
                "completion_tokens": completion_tokens, **source_counts},
        extra={"target": spec.target, "tokenizer_hash": tok_hash, "endpoint": spec.endpoint, "metrics": metrics},
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
        saved = json.loads(ctx.output.get_bytes(PROMPTS_FILE))
        prompts = {p["id"]: Prompt(**p) for p in saved["prompts"]}
        journal = Journal(ctx.output, flush_every=spec.checkpoint_every, on_commit=work.finished)

        async def main() -> dict[str, int]:
            engine = _make_engine(spec)
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

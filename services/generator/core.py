"""Generator stage: regenerate every assistant turn of a prompt set with the target (through an OpenAI-compatible
endpoint, or in-process for the embedded default), and store conversations as JSONL shards + manifest.

Each assistant turn is conditioned on the regenerated history; the system prompt is kept. Records keep
reasoning_content beside content (both are what the drafter learns), finish_reason and usage per turn, and the
sampling parameters and chat-template kwargs used.
"""
from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from pathlib import Path

from pydantic import Field, field_validator

from eyas.manifest import ArtifactWriter, Manifest
from eyas.stages import StageContext, StageResult, StageSpec
from eyas.target import BUNDLED, load_tokenizer, tokenizer_hash
from services.generator.dataset import Prompt, PromptFileError, bundled_prompt_file, load_prompts
from services.generator.engine import Engine, EngineError, HttpEngine, InProcessEngine, SamplingParams

log = logging.getLogger(__name__)
INPUT_FIELD = "prompts"


def resolve_prompt_file(prompts: str) -> Path:
    if prompts.startswith("bundled:"):
        name = prompts.split(":", 1)[1]
        if name not in ("sharegpt", "mt_bench"):
            raise PromptFileError(f"unknown bundled prompt set {name!r} (bundled:sharegpt or bundled:mt_bench)")
        return bundled_prompt_file(name)
    return Path(prompts)


class Spec(StageSpec):
    prompts: str = Field(description="prompt file (messages-JSONL, ShareGPT, MT-bench) or bundled:sharegpt")
    endpoint: str | None = Field(None, description="OpenAI-compatible base URL; none = in-process target")
    model: str | None = Field(None, description="served model name at the endpoint (default: the target)")
    target: str = Field(BUNDLED, description="the target whose chat template the data is for")
    sampling: SamplingParams = SamplingParams()
    concurrency: int = Field(16, ge=1, le=4096)
    limit: int | None = Field(None, ge=1, description="use the first N prompts")
    max_turns: int | None = Field(None, ge=1, description="regenerate at most this many assistant turns")
    shard_size: int = Field(1000, ge=1)

    @field_validator("prompts")
    @classmethod
    def _prompts_readable(cls, v: str) -> str:
        if v.startswith(("s3://", "pending")):
            return v
        load_prompts(resolve_prompt_file(v), limit=1)  # raises PromptFileError naming the record and field
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint_http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("endpoint must be an http(s):// URL")
        return v


async def _converse(engine: Engine, prompt: Prompt, spec: Spec) -> dict:
    messages: list[dict] = [{"role": "system", "content": prompt.system}] if prompt.system else []
    turns = []
    for user in prompt.user_turns[: spec.max_turns]:
        messages.append({"role": "user", "content": user})
        c = await engine.chat([{"role": m["role"], "content": m["content"]} for m in messages], spec.sampling)
        reply = {"role": "assistant", "content": c.content}
        if c.reasoning_content:
            reply["reasoning_content"] = c.reasoning_content
        messages.append(reply)
        turns.append({"finish_reason": c.finish_reason, "prompt_tokens": c.prompt_tokens,
                      "completion_tokens": c.completion_tokens, "latency_s": round(c.latency_s, 3)})
    return {"id": prompt.id, "source": prompt.source, "messages": messages, "turns": turns,
            "sampling": spec.sampling.model_dump(exclude={"chat_template_kwargs"}),
            "chat_template_kwargs": spec.sampling.chat_template_kwargs, **({"meta": prompt.meta} if prompt.meta else {})}


async def generate(spec: Spec, prompts: list[Prompt], engine: Engine, ctx: StageContext) -> tuple[list[dict], list[dict]]:
    """Run every prompt with at most `concurrency` in flight. Returns (records in prompt order, failures)."""
    sem = asyncio.Semaphore(spec.concurrency)
    results: dict[str, dict] = {}
    failures: list[dict] = []
    tokens, t0 = 0, time.monotonic()

    async def one(p: Prompt):
        nonlocal tokens
        async with sem:
            try:
                rec = await _converse(engine, p, spec)
            except EngineError as e:
                failures.append({"id": p.id, "error": str(e)})
                return
        results[p.id] = rec
        tokens += sum(t["completion_tokens"] for t in rec["turns"])
        ctx.metrics.update(completed=len(results), failed=len(failures), completion_tokens=tokens,
                           tokens_per_s=round(tokens / max(time.monotonic() - t0, 1e-9), 1))
        ctx.progress(len(results) + len(failures), len(prompts), "prompts")

    from tqdm.asyncio import tqdm

    await tqdm.gather(*(one(p) for p in prompts), desc="generate", unit="prompt")
    return [results[p.id] for p in prompts if p.id in results], failures


def run(spec: Spec, ctx: StageContext) -> StageResult:
    if spec.prompts.startswith("s3://"):
        from eyas.store import open_artifact

        bucket_uri, _, name = spec.prompts.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="eyas-prompts-") as tmp:
            # keep the object's file name: prompt ids derive from it and must not change between runs
            open_artifact(bucket_uri).get_file(name, Path(tmp) / name)
            prompts = load_prompts(Path(tmp) / name, limit=spec.limit)
    else:
        prompts = load_prompts(resolve_prompt_file(spec.prompts), limit=spec.limit)
    tok_hash = tokenizer_hash(load_tokenizer(spec.target))

    async def main():
        engine: Engine = (HttpEngine(spec.endpoint, spec.model or "target") if spec.endpoint
                          else InProcessEngine(spec.target, max_batch=spec.concurrency))
        try:
            return await generate(spec, prompts, engine, ctx)
        finally:
            await engine.aclose()

    t0 = time.monotonic()
    records, failures = asyncio.run(main())
    elapsed = time.monotonic() - t0
    writer = ArtifactWriter(ctx.output)
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
    metrics = {"completed": len(records), "failed": len(failures), "completion_tokens": completion_tokens,
               "tokens_per_s": round(completion_tokens / max(elapsed, 1e-9), 1), "seconds": round(elapsed, 1)}
    writer.commit(Manifest(
        kind="dataset", id=ctx.job_id, job_spec=spec.model_dump(mode="json"), inputs=[spec.prompts],
        counts={"prompts": len(prompts), "conversations": len(records), "failed": len(failures),
                "completion_tokens": completion_tokens},
        extra={"target": spec.target, "tokenizer_hash": tok_hash, "endpoint": spec.endpoint, "metrics": metrics},
    ))
    log.info("generated %d conversations (%d failed), %d tokens at %.1f tok/s → %s", len(records), len(failures),
             completion_tokens, metrics["tokens_per_s"], ctx.output.uri)
    return StageResult(output_uri=ctx.output.uri, metrics=metrics)

"""Step times for the serving cost model (services.evaluator.costmodel), measured on the serving engine.

Against a vLLM endpoint: b concurrent streaming completions of the same short prompt, ignore_eos and a fixed
max_tokens, decode in lockstep, one token per sequence per step. Their prefills may spread over several steps (and
share them with others' decodes), so only the window in which every request is decoding counts: from the last
request's first token to the first request's last; a request's seconds / tokens within it is the step time at batch
b, i.e. one target forward over b tokens with a KV cache, as the server runs it (scheduler, sampler, streaming). Few
points (b = 1, 2, 4, … 64) and short generations keep the
whole measurement well under a minute on vLLM-CPU; the cost model interpolates between them.

On a speculative server the same window gives the engine's own speculative step at batch b: a streamed chunk is
one engine step of one request (its accepted drafts and the bonus token), so a request's seconds / chunks within
the window is the step: K draft forwards, the verify forward over b·(K+1) tokens and whatever the engine adds. Less
the target's forward over those b·(K+1) tokens (the plain endpoint's points), what remains is the drafter's cost
inside the engine (services.evaluator.serving.engine_draft_times).

In-process (the default, no endpoint): the target's forward over [b, n] new tokens after a KV cache of
CONTEXT tokens, and the drafter's step at batch b, READINGS timed calls of each: the point is the fastest (the least
disturbed), the gap to the next fastest its noise. The drafter runs in-process until a speculative server
measures it in the engine: that is its cost on this machine, not inside the engine (the report says so; inside
vLLM-CPU a draft step cost 2-3 times the in-process one: bench/README.md § Serving prediction). On a CPU both run
on one thread, as vLLM-CPU runs its model on one core: on a shared CPU, several threads mostly measure contention
(their readings of a draft step spread several times wider than one thread's).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from eyas.methods import method_of_drafter
from eyas.target import Target
from services.evaluator.live import auth_headers, served_model

log = logging.getLogger(__name__)

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT = 128  # tokens already in the KV cache when a step runs (a typical prompt)
STEPS = 16  # tokens each request decodes per measured point
READINGS = 5  # timed calls per in-process point: one reading of a step on a shared CPU is mostly noise
# what the in-process points take, about, for the bundled target on 2 cores (a deadline keeps it): the time 2
# readings a point took, scaled by the calls READINGS makes
STEP_TIMES_S = 55.0


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict) -> list[tuple[float, int]]:
    """(arrival time, tokens so far) of each streamed chunk (a chunk may carry more than one token)."""
    seen: list[tuple[float, int]] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                tokens += sum(len(c.get("token_ids") or []) for c in choices)
                seen.append((time.perf_counter(), tokens))
    return seen


def _window(runs: list[list[tuple[float, int]]]) -> list[tuple[float, int, int]]:
    """(seconds, tokens, engine steps) of each request between its first and last chunk while every request
    decodes (one chunk a step: the steps are the chunks after the first)."""
    start, end = max(r[0][0] for r in runs), min(r[-1][0] for r in runs)
    spans = []
    for r in runs:
        inside = [(t, n) for t, n in r if start <= t <= end]
        if len(inside) > 1 and inside[-1][1] > inside[0][1]:
            spans.append((inside[-1][0] - inside[0][0], inside[-1][1] - inside[0][1], len(inside) - 1))
    if not spans:
        raise RuntimeError("no decode window shared by all requests: raise the tokens per request")
    return spans


async def _streams(url: str, model: str, prompts: list[list[int]], steps: int,
                   api_key: str | None) -> list[list[tuple[float, int]]]:
    """One greedy streaming request per prompt, all at once, each decoding `steps` tokens (ignore_eos)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0 + steps * 10.0), headers=auth_headers(api_key),
                                 limits=httpx.Limits(max_connections=len(prompts))) as client:
        return await asyncio.gather(*(_stream_one(client, url, {
            "model": model, "prompt": p, "max_tokens": steps, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}) for p in prompts))


def endpoint_step_times(url: str, prompt: list[int], batches: tuple[int, ...] = BATCHES, steps: int = STEPS,
                        api_key: str | None = None) -> list[tuple[int, float]]:
    """(b, seconds per decode step at batch b) on the endpoint, after one untimed warm-up batch."""
    model = served_model(url, api_key)
    asyncio.run(_streams(url, model, [prompt] * max(batches), 2, api_key))
    out = []
    for b in batches:
        spans = _window(asyncio.run(_streams(url, model, [prompt] * b, steps, api_key)))
        out.append((b, statistics.median(s / n for s, n, _ in spans)))  # seconds per token of one request
    return out


def endpoint_spec_step_times(url: str, prompt: list[int], batches: tuple[int, ...], steps: int = STEPS,
                             api_key: str | None = None) -> tuple[list[tuple[int, float]], float | None]:
    """(b, seconds per engine step at batch b) on a speculative endpoint, after one untimed warm-up batch, and
    the tokens a step emitted on average over the measurement (τ on these prompts; None: no step counted). A
    request decodes `steps` · 4 tokens: several are emitted a step."""
    model = served_model(url, api_key)
    asyncio.run(_streams(url, model, [prompt] * max(batches), 2, api_key))
    out, tokens, taken = [], 0, 0
    for b in batches:
        spans = _window(asyncio.run(_streams(url, model, [prompt] * b, steps * 4, api_key)))
        out.append((b, statistics.median(s / k for s, _, k in spans)))  # seconds per step of one request
        tokens, taken = tokens + sum(n for _, n, _ in spans), taken + sum(k for _, _, k in spans)
    return out, (tokens / taken if taken else None)


def endpoint_decode_rate(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                         api_key: str | None = None) -> float:
    """Tokens/s of `concurrency` streams (the first prompts) while all of them decode: the steady state the cost
    model predicts, without the prefills and the partly filled batches at the end that an A/B's wall time holds.
    On a speculative server a chunk carries the step's accepted tokens and bonus."""
    model = served_model(url, api_key)
    spans = _window(asyncio.run(_streams(url, model, [prompts[i % len(prompts)] for i in range(concurrency)],
                                         max_tokens, api_key)))
    return sum(n / s for s, n, _ in spans)


def readings(fn, *args, repeats: int = READINGS, warm_up: bool = True) -> list[float]:
    """Seconds of `repeats` timed calls, fastest first (after a warm-up call unless the caller warmed this path up
    already). The fastest is the least disturbed by other work on the machine; how far the next ones lie above it
    is the noise (services.evaluator.serving)."""
    if warm_up:
        fn(*args)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return sorted(out)


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _target_step(model, new: torch.Tensor, cache) -> None:
    model(input_ids=new, past_key_values=cache, use_cache=True)
    cache.crop(-new.shape[1])  # the next call sees the same cache


def _hybrid(config) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


# The target's in-process readings are the machine's and the architecture's, not a drafter's: they are kept in a file
# under the cache directory, per architecture (the config hash), precision, device, points and host, and taken again
# once READINGS_KEPT_S old. The next evaluation of the same target on this machine reuses them, in this process or
# another: eyas run --method auto evaluates three drafters, a worker every job, a second eyas run within the hour.
READINGS_KEPT_S = 3600.0


def _readings_file(target: Target, tokens: tuple[int, ...], max_batch: int, context: int, cache_dir: Path) -> Path:
    key = [target.config_hash, target.precision, str(target.input_device), list(tokens), max_batch, context,
           platform.node(), os.cpu_count(), torch.__version__]
    return cache_dir / "step-times" / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]}.json"


def _kept_readings(path: Path, tokens: tuple[int, ...]) -> list[tuple[int, list[float]]] | None:
    """The readings in `path` while younger than READINGS_KEPT_S (None: none, aged, or unreadable)."""
    try:
        kept = json.loads(path.read_text())
        points = [(int(n), [float(t) for t in r]) for n, r in kept["points"]]
        age = time.time() - float(kept["taken"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return points if 0 <= age <= READINGS_KEPT_S and tuple(n for n, _ in points) == tokens else None


def target_step_times(target: Target, tokens: tuple[int, ...], max_batch: int = max(BATCHES),
                      context: int = CONTEXT, *, cache_dir: Path,
                      check: Callable[[], None]) -> list[tuple[int, list[float]]]:
    """(n, READINGS readings, fastest first, of one target forward over n new tokens) in-process: b = min(n,
    max_batch) sequences of n / b tokens each after `context` cached tokens, logits for every new token (as a verify
    step needs); `check()` (a cancel) before each point. The readings kept under `cache_dir` for this target and
    machine when younger than READINGS_KEPT_S, else taken now and kept there."""
    path = _readings_file(target, tokens, max_batch, context, cache_dir)
    points = _kept_readings(path, tokens)
    if points is None:
        points = _measure_target(target, tokens, max_batch, context, check)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")  # another process may write the same file
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps({"taken": time.time(), "target": target.name, "points": points}))
            os.replace(partial, path)
        except OSError as e:  # a cache that cannot be written costs the next evaluation a measurement, no more
            log.warning("step times not kept under %s: %s", cache_dir, e)
    return points


@torch.inference_mode()
def _measure_target(target: Target, tokens: tuple[int, ...], max_batch: int, context: int,
                    check: Callable[[], None]) -> list[tuple[int, list[float]]]:
    from transformers import DynamicCache

    model, on = target.model, target.input_device
    vocab, hybrid = model.config.vocab_size, _hybrid(model.config)
    out = []
    with _one_thread_on_cpu(on):
        for n in tokens:
            check()
            b = min(n, max_batch)
            # no config: every layer keeps all its keys, so crop() can undo a step even in sliding-window
            # layers (gpt-oss) once context + n passes the window; the masks still apply the window. A hybrid
            # target's linear-attention layers need their own cache layers (the config's): recording their past
            # lets crop() undo a step's conv states; their recurrent state keeps the step, a fixed-size state whose
            # values do not change a step's time. They cannot repeat a batch, so a hybrid prefills all b sequences
            cache = DynamicCache(config=model.config) if hybrid else DynamicCache()
            if hybrid:
                cache.activate_past_recording()
            model(input_ids=torch.randint(vocab, (b if hybrid else 1, context), device=on), past_key_values=cache,
                  use_cache=True)
            if not hybrid:
                cache.batch_repeat_interleave(b)  # the same context in every sequence: [b, kv heads, context, hd]
            new = torch.randint(vocab, (b, n // b), device=on)
            # one warm-up call for the first point: the later ones run the same kernels at other shapes
            out.append((n, readings(_target_step, model, new, cache, warm_up=not out)))
    return out


@torch.inference_mode()
def drafter_step_times(drafter: Any, batches: tuple[int, ...] = BATCHES,
                       context: int = CONTEXT, *, check: Callable[[], None]) -> list[tuple[int, list[float]]]:
    """(x, READINGS readings, fastest first, of one draft step at batch b), as the drafter's method drafts: a chain
    (EAGLE-3, P-EAGLE) one token per sequence attending to `context` step-0 keys, x = b; a block (DFlash) its block
    in one forward, x = b · (block − 1) tokens drafted. `check()` (a cancel) before each point."""
    method = method_of_drafter(drafter)
    out = []
    with _one_thread_on_cpu(drafter.fc.weight.device):
        for b in batches:
            check()
            drafted, step = method.draft_step(drafter, b, context)
            out.append((drafted, readings(step)))
    return out

"""Chat engines behind one interface: `await engine.chat(messages, params) -> Completion`.

HttpEngine talks to any OpenAI-compatible server (vLLM, SGLang). InProcessEngine drives a local transformers model
(the default without an endpoint: the SQLite of generation — convenient on one machine, never the production
path); it batches concurrent requests into one `generate` call. Both produce identical Completion records.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from eyas.render import render_prompt_text
from eyas.stage import Cancelled
from services.generator.spec import SamplingParams


@dataclass
class Completion:
    content: str
    reasoning_content: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(RuntimeError):
    """A request that failed; `status` is the HTTP status when there was one, `retry_after` the server's hint,
    `timed_out` whether no answer came within the read timeout."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None,
                 timed_out: bool = False):
        super().__init__(message)
        self.status, self.retry_after, self.timed_out = status, retry_after, timed_out


class Engine(Protocol):
    # timeout_s: this request's read timeout, where the engine has one (default: sized to the request)
    async def chat(self, messages: list[dict], params: SamplingParams,
                   timeout_s: float | None = None) -> Completion: ...

    async def complete_many(self, texts: list[str], params: SamplingParams) -> list[Completion]:
        """Raw-text completions (no chat template), stopping at the end-of-turn token; with a seed, request i
        is reproducible (it samples with seed + i, or per fixed batch in-process)."""
        ...

    async def aclose(self) -> None: ...


def request_timeout(max_tokens: int, min_tokens_per_s: float = 2.0, base_s: float = 30.0) -> float:
    """A read timeout sized to the request: a long generation is not a hung one (never the client's 60 s)."""
    return base_s + max_tokens / min_tokens_per_s


POOL_CONNECTIONS = 8
NUCLEUS_TOP = 1024  # candidates in-process top-p sampling sorts first (services.generator.engine: _pick)
PREFILL_ROWS = 16  # rows per prefill forward, grouped by prompt length (InProcessEngine._prefill)


class HttpEngine:
    def __init__(self, endpoint: str, model: str, api_key: str | None = None, max_connections: int = 256,
                 min_tokens_per_s: float = 2.0, timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self.url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/v1") else "/v1")
        self.model = model
        self.api_key = api_key  # the endpoint check (services.generator.endpoint_check) sends it too
        self.min_tokens_per_s = min_tokens_per_s
        self.max_connections = max_connections  # also the most raw completions `complete_many` keeps in flight
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # httpx's pool does work in proportion to its connections on every request: at hundreds in flight one
        # pool costs more CPU than the requests themselves, so requests take turns over pools of about
        # POOL_CONNECTIONS each (8 rather than 16: less CPU per request; bench/README.md § Generator under load)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.clients = [httpx.AsyncClient(headers=headers, limits=limits)
                        for _ in range(-(-max_connections // POOL_CONNECTIONS))]
        self._turn = itertools.cycle(self.clients)

    def full_timeout(self, max_tokens: int) -> float:
        """A request's read timeout: the job's, else sized to its max_tokens."""
        return self.timeout_s or request_timeout(max_tokens, self.min_tokens_per_s)

    async def _post(self, path: str, body: dict[str, Any], max_tokens: int,
                    timeout_s: float | None = None) -> dict[str, Any]:
        timeout = httpx.Timeout(timeout_s or self.full_timeout(max_tokens), connect=10.0)
        try:
            resp = await next(self._turn).post(f"{self.url}{path}", json=body, timeout=timeout)
        except httpx.TimeoutException as e:
            raise EngineError(f"timeout after {timeout.read:.0f} s: {type(e).__name__}",
                              timed_out=isinstance(e, httpx.ReadTimeout)) from e
        except httpx.TransportError as e:
            raise EngineError(f"connection error: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            retry_after = resp.headers.get("retry-after")
            raise EngineError(f"HTTP {resp.status_code}: {resp.text[:300]}", status=resp.status_code,
                              retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None)
        try:
            data = resp.json()
            data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise EngineError(f"malformed response: {resp.text[:200]!r}") from e
        return data

    async def chat(self, messages: list[dict], params: SamplingParams, timeout_s: float | None = None) -> Completion:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.chat_template_kwargs:
            body["chat_template_kwargs"] = params.chat_template_kwargs
        t0 = time.monotonic()
        data = await self._post("/chat/completions", body, params.max_tokens, timeout_s)
        choice = data["choices"][0]
        msg = choice["message"]
        usage = data.get("usage") or {}
        return Completion(
            content=msg.get("content") or "",
            reasoning_content=msg.get("reasoning_content") or msg.get("reasoning"),
            finish_reason=choice.get("finish_reason") or "unknown",
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            latency_s=time.monotonic() - t0,
        )

    async def complete_many(self, texts: list[str], params: SamplingParams) -> list[Completion]:
        sem = asyncio.Semaphore(self.max_connections)

        async def one(i: int, text: str) -> Completion:
            body: dict[str, Any] = {"model": self.model, "prompt": text, "max_tokens": params.max_tokens,
                                    "temperature": params.temperature, "top_p": params.top_p}
            if params.seed is not None:
                body["seed"] = params.seed + i
            async with sem:
                data = await self._post("/completions", body, params.max_tokens)
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return Completion(content=choice.get("text") or "", reasoning_content=None,
                              finish_reason=choice.get("finish_reason") or "unknown",
                              prompt_tokens=int(usage.get("prompt_tokens", 0)),
                              completion_tokens=int(usage.get("completion_tokens", 0)))

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(texts))))

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


class InProcessEngine:
    """Batched greedy/sampled generation with a local transformers model, behind the HTTP engine's interface.
    `check()` runs before every forward (prefill group, decoding step) and may raise (eyas.stage.Cancelled): the
    batch in flight stops there, and its requests raise it."""

    def __init__(self, target_name: str, max_batch: int = 16, check: Callable[[], None] = lambda: None):
        import torch

        from eyas.target import load_target

        self.torch = torch
        self.target = load_target(target_name)
        self.tok = self.target.tokenizer
        self.max_batch = max_batch
        self.check = check
        self._pending: list[tuple[list[dict], SamplingParams, asyncio.Future]] = []
        self._wakeup: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None
        self._lock = threading.Lock()  # one generate at a time; the model is not re-entrant

    async def chat(self, messages: list[dict], params: SamplingParams, timeout_s: float | None = None) -> Completion:
        del timeout_s  # the batch in flight runs to its end (a cancel stops it at its next step)
        loop = asyncio.get_running_loop()
        if self._runner is None:
            self._wakeup = asyncio.Event()
            self._runner = loop.create_task(self._run())
        fut: asyncio.Future = loop.create_future()
        self._pending.append((messages, params, fut))
        self._wakeup.set()
        return await fut

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            await asyncio.sleep(0.01)  # let concurrent callers join the batch
            self._wakeup.clear()
            while self._pending:
                # one batch = requests with identical sampling parameters
                key = self._pending[0][1]
                batch = [p for p in self._pending if p[1] == key][: self.max_batch]
                for p in batch:
                    self._pending.remove(p)
                try:
                    texts = [self.render(b[0], key) for b in batch]
                    results = await asyncio.to_thread(self.generate_texts, texts, key)
                    for (_, _, fut), res in zip(batch, results, strict=True):
                        if not fut.done():
                            fut.set_result(res)
                except Exception as e:  # every waiter learns why (a cancel as itself: nothing to retry)
                    for _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e if isinstance(e, Cancelled) else
                                              EngineError(f"in-process generation failed: {e}"))

    def render(self, messages: list[dict], params: SamplingParams) -> str:
        return render_prompt_text(self.tok, messages, params.chat_template_kwargs)

    async def complete_many(self, texts: list[str], params: SamplingParams) -> list[Completion]:
        # Fixed batches in order, each seeded from (seed, batch index): reproducible whatever else runs.
        out: list[Completion] = []
        for b, i in enumerate(range(0, len(texts), self.max_batch)):
            p = params if params.seed is None else params.model_copy(update={"seed": params.seed + b})
            out += await asyncio.to_thread(self.generate_texts, texts[i:i + self.max_batch], p)
        return out

    def generate_texts(self, texts: list[str], params: SamplingParams) -> list[Completion]:
        t0 = time.monotonic()
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        from eyas.decoding import grouped_sdpa

        with self._lock, self.torch.inference_mode(), grouped_sdpa(self.target.model):
            rows = self._decode(enc["input_ids"], enc["attention_mask"], params)
        latency = time.monotonic() - t0
        results = []
        for ids, attn in zip(rows, enc["attention_mask"], strict=True):
            stop = ids.index(self.tok.eos_token_id) if self.tok.eos_token_id in ids else None
            kept = ids[:stop] if stop is not None else ids
            results.append(Completion(
                content=self.tok.decode(kept, skip_special_tokens=True),
                reasoning_content=None,
                finish_reason="stop" if stop is not None else "length",
                prompt_tokens=int(attn.sum()),
                completion_tokens=len(kept) + (1 if stop is not None else 0),
                latency_s=latency,
            ))
        return results

    def _decode(self, ids, mask, params: SamplingParams) -> list[list[int]]:
        """Greedy or sampled decoding (temperature, top-p) with a KV cache that drops each row from the batch once
        it has ended: a batch costs the tokens it generates, not rows × its longest row as `generate` does (most
        of all for prompt synthesis, whose requests are mostly far shorter than max_tokens). The cache grows in
        place (eyas.decoding; bench/README.md § In-process decoding)."""
        from eyas.decoding import growing_cache

        torch, model, eos = self.torch, self.target.model, self.tok.eos_token_id
        rng = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        out: list[list[int]] = [[] for _ in range(len(ids))]
        alive = torch.arange(len(ids))  # batch row → request
        cache = growing_cache(model.config, ids.shape[1] + params.max_tokens)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
        logits = self._prefill(ids, mask, positions, cache)  # [rows, V]: the last position only
        last = positions[:, -1]
        for step in range(params.max_tokens):
            self.check()
            nxt = self._pick(logits, params, rng)  # [rows]
            for r, t in zip(alive.tolist(), nxt.tolist(), strict=True):
                out[r].append(t)
            keep = (nxt != eos).nonzero().squeeze(1)
            if step == params.max_tokens - 1 or keep.numel() == 0:
                break
            if keep.numel() < alive.numel():  # rows that ended leave the batch and the cache
                alive, nxt, mask, last = alive[keep], nxt[keep], mask[keep], last[keep]
                cache.batch_select_indices(keep)
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            last = last + 1
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
        return out

    def _prefill(self, ids, mask, positions, cache):
        """The prompts' forward in groups of PREFILL_ROWS rows of similar length, each cut to its own longest
        prompt, their keys and values written into the batch's cache at their slots: the padding up to the batch's
        longest prompt costs nothing (it was half of a batch's prefill, and prefill a third of its time, for
        synthesized prompts). Logits [rows, V] of each prompt's last position. A cache with layers of other kinds
        (sliding windows) gets one padded forward."""
        from transformers import DynamicCache

        from eyas.decoding import GrowingKVLayer

        model = self.target.model
        if not all(isinstance(layer, GrowingKVLayer) for layer in cache.layers):
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1).logits[:, -1]
        width, lengths = ids.shape[1], mask.sum(-1)
        order = lengths.argsort()
        logits = None
        for i in range(0, len(order), PREFILL_ROWS):
            self.check()
            rows = order[i:i + PREFILL_ROWS]
            cut = width - int(lengths[rows].max())
            part = DynamicCache(config=model.config)
            out = model(input_ids=ids[rows, cut:], attention_mask=mask[rows, cut:], position_ids=positions[rows, cut:],
                        past_key_values=part, use_cache=True, logits_to_keep=1).logits[:, -1]
            if logits is None:
                logits = out.new_empty(len(ids), out.shape[-1])
            logits[rows] = out
            for layer, got in zip(cache.layers, part.layers, strict=True):
                layer.write_rows(rows, len(ids), width, got.keys, got.values)
        return logits

    def _pick(self, logits, params: SamplingParams, rng):
        torch = self.torch
        if params.temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        if params.top_p >= 1.0:
            return torch.multinomial(probs, 1, generator=rng).squeeze(1)
        # nucleus: the most likely tokens until their mass reaches top_p. The top NUCLEUS_TOP (sorted) hold it
        # unless the distribution is very flat; sorting the whole vocabulary instead cost as much as the model's
        # step (batch 72, V = 49152, 2 cores)
        p, order = probs.topk(min(NUCLEUS_TOP, probs.shape[-1]), dim=-1)
        flat = p.sum(-1) < params.top_p  # rows whose nucleus reaches past the top: only those sort everything
        out = torch.empty(len(probs), dtype=torch.int64)
        if bool((~flat).any()):
            out[~flat] = self._nucleus(p[~flat], order[~flat], params.top_p, rng)
        if bool(flat.any()):
            out[flat] = self._nucleus(*probs[flat].sort(dim=-1, descending=True), params.top_p, rng)
        return out

    def _nucleus(self, p, order, top_p: float, rng):
        """Sample from probabilities `p` sorted descending ([rows, n], token ids `order`) within their top_p."""
        p[(p.cumsum(-1) - p) >= top_p] = 0.0
        return order.gather(-1, self.torch.multinomial(p, 1, generator=rng)).squeeze(1)

    async def aclose(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            self._runner = None

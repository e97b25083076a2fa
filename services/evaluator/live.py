"""Live A/B on real vLLM endpoints: the same prompts (token ids, greedy) without and with the drafter.

Throughput is completion tokens / wall time at a fixed concurrency. Acceptance comes from the speculative server's
Prometheus counters, read before and after the run (deltas, so earlier traffic does not count):
  τ = 1 + Δaccepted / Δdrafts,   per-position acceptance_i = Δaccepted_per_pos[i] / Δdrafts   (vLLM's definitions)
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # only named in annotations: reading counters (eyas watch) imports no torch
    from services.evaluator.specdec import PromptIds

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: dict[int, float]

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts, self.draft_tokens - other.draft_tokens, self.accepted - other.accepted,
            {i: v - other.accepted_per_pos.get(i, 0.0) for i, v in self.accepted_per_pos.items()})

    def summary(self) -> dict:
        d = self.drafts
        per_pos = [self.accepted_per_pos[i] for i in sorted(self.accepted_per_pos)]
        return {"drafts": int(d), "draft_tokens": int(self.draft_tokens), "accepted": int(self.accepted),
                "accepted_per_pos": [int(x) for x in per_pos],
                "acceptance_length": 1 + self.accepted / d if d else None,
                "per_position_acceptance": [x / d if d else None for x in per_pos]}


def parse_counters(text: str) -> SpecCounters:
    """Sum vLLM's spec-decode counters over engines/models from a /metrics page."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            if fam.name == ACCEPTED_PER_POS:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            elif fam.name in totals:
                totals[fam.name] += s.value
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED], per_pos)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header for an endpoint that wants a key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def read_counters(url: str, settle_s: float = 0.5, timeout_s: float = 15.0, api_key: str | None = None) -> SpecCounters:
    """Counters once they stop moving: vLLM records a step's stats just after it returns the step's output."""
    deadline = time.monotonic() + timeout_s
    last = parse_counters(httpx.get(f"{url}/metrics", timeout=10, headers=auth_headers(api_key)).text)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = parse_counters(httpx.get(f"{url}/metrics", timeout=10, headers=auth_headers(api_key)).text)
        if now == last:
            return now
        last = now
    return last


def served_model(url: str, api_key: str | None = None) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10, headers=auth_headers(api_key)).json()["data"][0]["id"]


async def _run(url: str, model: str, prompts: list[PromptIds], max_tokens: int, concurrency: int,
               api_key: str | None) -> list[list[int]]:
    sem = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(30.0 + max_tokens * 2.0)
    async with httpx.AsyncClient(timeout=timeout, headers=auth_headers(api_key)) as client:
        async def one(p: PromptIds) -> list[int]:
            async with sem:
                r = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": p.ids, "max_tokens": max_tokens, "temperature": 0.0,
                    "return_token_ids": True})
                r.raise_for_status()
                return r.json()["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


def timed_completions(url: str, prompts: list[PromptIds], max_tokens: int, concurrency: int = 1,
             counters: bool = False, api_key: str | None = None) -> dict:
    """Greedy completions of token-id prompts after one untimed warm-up request: outputs, completion tokens,
    tok/s, and with `counters` the server's spec-decode acceptance over exactly this run."""
    model = served_model(url, api_key)
    asyncio.run(_run(url, model, prompts[:1], 8, 1, api_key))
    before = read_counters(url, api_key=api_key) if counters else None
    t0 = time.perf_counter()
    outputs = asyncio.run(_run(url, model, prompts, max_tokens, concurrency, api_key))
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    result = {"url": url, "model": model, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
              "concurrency": concurrency, "outputs": outputs}
    if before is not None:
        result.update((read_counters(url, api_key=api_key) - before).summary())
    return result


def live_ab(prompts: list[PromptIds], max_tokens: int, endpoint: str | None, spec_endpoint: str | None,
            concurrency: int = 1, api_key: str | None = None) -> dict:
    """Baseline (endpoint) and speculative (spec_endpoint) runs, each optional; speed-up when both ran. `api_key`
    (the settings' endpoint key) goes to both as a bearer token."""
    out: dict = {"prompts": len(prompts), "max_tokens": max_tokens, "concurrency": concurrency}
    if endpoint:
        out["baseline"] = timed_completions(endpoint, prompts, max_tokens, concurrency, api_key=api_key)
    if spec_endpoint:
        out["speculative"] = timed_completions(spec_endpoint, prompts, max_tokens, concurrency, counters=True,
                                               api_key=api_key)
    if endpoint and spec_endpoint:
        out["speedup"] = out["speculative"]["tok_s"] / out["baseline"]["tok_s"]
        out["outputs_equal"] = out["speculative"]["outputs"] == out["baseline"]["outputs"]
    return out

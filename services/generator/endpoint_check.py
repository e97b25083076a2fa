"""Before a generate job sends its first prompt: does the endpoint serve the target the features will be extracted
from? A drafter trained on another model's answers would learn nothing about the target, without a word.

vLLM's `/tokenize` renders a probe conversation with the served model's own chat template (and the job's chat
template kwargs) and tokenizes it; the result must equal the target's rendering (eyas.render.render_prompt), token
for token — same vocabulary, same template. A difference fails the job at once, naming both models. An endpoint
without `/tokenize` cannot be checked: the job goes on, and its record carries a warning naming what the endpoint
lists (its `/v1/models`), if anything.
"""
from __future__ import annotations

from typing import Any

import httpx

from eyas.render import render_prompt
from services.generator.engine import HttpEngine

PROBE = [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is the capital of France? Answer in one word."}]


class EndpointServesAnotherModel(ValueError):
    pass


async def model_cards(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """The model cards the endpoint lists at `url`/models (`url` ends in /v1); [] when it lists none."""
    try:
        resp = await client.get(f"{url}/models")
        data = resp.json()["data"] if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def card_name(card: dict[str, Any]) -> str:
    """'id (root)' of a model card, or its id alone when the root says nothing more."""
    return f"{card.get('id')} ({card['root']})" if card.get("root") and card["root"] != card.get("id") \
        else str(card.get("id"))


async def _served_models(client: httpx.AsyncClient, engine: HttpEngine) -> list[str]:
    """'id (root)' of each model the endpoint lists; [] when it lists none."""
    return [card_name(m) for m in await model_cards(client, engine.url)]


async def tokenize_probe(client: httpx.AsyncClient, url: str, model: str, template_kwargs: dict[str, Any],
                         messages: list[dict[str, str]] = PROBE) -> list[int] | None:
    """The endpoint's tokens for the probe conversation (`messages`), rendered with its own chat template (`url`
    ends in /v1); None when it offers no /tokenize."""
    body: dict[str, Any] = {"model": model, "messages": messages, "add_generation_prompt": True}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    try:  # /tokenize lives beside /v1, not under it
        resp = await client.post(f"{url.removesuffix('/v1')}/tokenize", json=body)
        return resp.json()["tokens"] if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


async def check_endpoint(engine: HttpEngine, tokenizer, target: str, template_kwargs: dict[str, Any]) -> dict:
    """{"endpoint_check": "tokenize"} when the endpoint renders and tokenizes the probe exactly as the target;
    {"warnings": [why not checked]} when it offers no /tokenize; raises EndpointServesAnotherModel otherwise."""
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as client:
        return await _check(client, engine, tokenizer, target, template_kwargs)


async def _check(client: httpx.AsyncClient, engine: HttpEngine, tokenizer, target: str,
                 template_kwargs: dict[str, Any]) -> dict:
    served = await tokenize_probe(client, engine.url, engine.model, template_kwargs)
    if served is None:
        models = await _served_models(client, engine)
        listed = f"it lists {', '.join(models)}" if models else "it lists no models"
        return {"warnings": [f"endpoint {engine.url} has no /tokenize, so it was not checked that it serves the "
                             f"target {target} ({listed})"]}
    ours = render_prompt(tokenizer, PROBE, template_kwargs)
    if served != ours:
        models = await _served_models(client, engine) or [engine.model]
        at = first_difference(served, ours)
        raise EndpointServesAnotherModel(
            f"endpoint {engine.url} serves {', '.join(models)}, not the target {target}: a probe conversation "
            f"renders to {len(served)} tokens there and {len(ours)} with the target's tokenizer and chat template, "
            f"first different at token {at}")
    return {"endpoint_check": "tokenize"}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where two token lists differ (the shorter one's length when one begins the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

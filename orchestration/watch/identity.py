"""Is the endpoint still serving the target the drafter was trained on? What can be read from outside, and what each
reading is compared with:

  model      the names the endpoint lists (/v1/models: id and root) ↔ --served-model, else what it listed when this
             watch first ran
  rendering  the probe conversation as the endpoint renders and tokenizes it with its own chat template (/tokenize,
             the generator's endpoint check: services.generator.endpoint_check), with its system turn and without
             (where a template writes its default system prompt) ↔ the same probes rendered by a local
             tokenizer whose tokenizer + chat-template hash is the one the drafter's layout records; where no such
             copy is here, ↔ the endpoint's own rendering when this watch first ran (a change, not the training's)
  config     the hash of the weights' config.json (eyas.target.config_hash) ↔ the layout's target_config_hash, where
             the endpoint's root is a directory readable here (vLLM does not publish its config)

A check that cannot be made says so, and why: it is never counted as passed.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eyas.layout import Layout
from orchestration.watch.status import CHANGED, NOT_CHECKED, SAME, Check
from services.evaluator.live import auth_headers
from services.generator.endpoint_check import PROBE, card_name, first_difference, model_cards, tokenize_probe

# The probe with its own system turn, then without one: a template's default system prompt (what a request without a
# system turn renders) shows only in the second (bench/README.md § The loop)
PROBES = (PROBE, [m for m in PROBE if m["role"] != "system"])


@dataclass
class Served:
    """What the endpoint shows of its target at one reading."""
    models: list[str]  # 'id (root)' of each model it lists
    roots: list[str]  # each listed model's root (or id): where it was loaded from
    tokens: list[int] | None  # the PROBES as it renders them, one after the other; None without /tokenize
    config_hash: str | None = None
    config_note: str = ""  # why there is no config hash

    def first_seen(self) -> dict[str, Any]:
        # (a watch's state from before the second probe keeps "tokens": not compared with these)
        return {"models": self.models, "probe_tokens": self.tokens}


@dataclass(frozen=True)
class Reference:
    """What the served target must be: the drafter's record, and what could be rendered here from it."""
    config_hash: str  # the layout's target_config_hash
    tokens: list[int] | None  # the PROBES rendered by the drafter's tokenizer and chat template, where one is here
    tokens_source: str  # where `tokens` come from, or why there are none
    model: str | None = None  # the name the endpoint must list, as the user gave it


def _config_of(roots: list[str]) -> tuple[str | None, str]:
    from eyas.target import config_hash

    for root in roots:
        if (Path(root) / "config.json").is_file():
            return config_hash(Path(root)), f"read from {root}"
    where = ", ".join(roots) or "none listed"
    return None, f"the endpoint does not publish its weights' config, and its root ({where}) is no directory here"


async def _read(client: httpx.AsyncClient, v1: str, template_kwargs: dict[str, Any]) -> Served:
    cards = await model_cards(client, v1)
    model = str(cards[0].get("id")) if cards else ""
    renderings = [await tokenize_probe(client, v1, model, template_kwargs, probe) for probe in PROBES]
    tokens = None if None in renderings else [t for r in renderings for t in r]
    roots = [str(c.get("root") or c.get("id")) for c in cards]
    return Served(models=[card_name(c) for c in cards], roots=roots, tokens=tokens)


def read_served(endpoint: str, template_kwargs: dict[str, Any], api_key: str | None = None) -> Served:
    """One reading of the endpoint's target identity (`endpoint` is its base URL, with or without /v1)."""
    v1 = endpoint.rstrip("/").removesuffix("/v1") + "/v1"

    async def read() -> Served:
        async with httpx.AsyncClient(headers=auth_headers(api_key), timeout=30.0) as client:
            return await _read(client, v1, template_kwargs)

    served = asyncio.run(read())
    served.config_hash, served.config_note = _config_of(served.roots)
    return served


def build_reference(layout: Layout, template_kwargs: dict[str, Any], candidates: list[str],
                    model: str | None = None) -> Reference:
    """The reference rendering from the first candidate target whose tokenizer + chat template hash to the drafter's
    recorded tokenizer_hash (a candidate that cannot be loaded, or hashes otherwise, is named in why there is none)."""
    from eyas.render import render_prompt
    from eyas.target import load_tokenizer, tokenizer_hash

    tried = []
    for candidate in dict.fromkeys(candidates):  # in order, each once
        try:
            tokenizer = load_tokenizer(candidate)
        except (OSError, ValueError) as e:
            tried.append(f"{candidate} cannot be loaded here ({type(e).__name__})")
            continue
        got = tokenizer_hash(tokenizer)
        if got == layout.tokenizer_hash:
            rendered = [t for probe in PROBES for t in render_prompt(tokenizer, probe, template_kwargs)]
            return Reference(layout.target_config_hash, rendered,
                             f"the drafter's tokenizer and chat template (hash {got}, from {candidate})", model)
        tried.append(f"{candidate} hashes to {got}")
    why = "; ".join(tried) or "no copy of the target named"
    return Reference(layout.target_config_hash, None,
                     f"no tokenizer here hashes to the drafter's {layout.tokenizer_hash} ({why})", model)


def _model_check(ref: Reference, served: Served, first: dict[str, Any]) -> Check:
    if not served.models:
        return Check("model", NOT_CHECKED, "the endpoint lists no models")
    if ref.model is not None:
        listed = ref.model in served.roots or any(m.split(" (")[0] == ref.model for m in served.models)
        return Check("model", SAME if listed else CHANGED, f"the endpoint serves {', '.join(served.models)}"
                     + ("" if listed else f", not {ref.model}"))
    was = first.get("models")
    if not was:
        return Check("model", NOT_CHECKED, "no earlier listing to compare with")
    if was != served.models:
        return Check("model", CHANGED, f"the endpoint serves {', '.join(served.models)}, where it served "
                                       f"{', '.join(was)} when the watch began")
    return Check("model", SAME, f"the endpoint serves {', '.join(served.models)}, as when the watch began")


def _rendering_check(ref: Reference, served: Served, first: dict[str, Any]) -> Check:
    if served.tokens is None:
        return Check("rendering", NOT_CHECKED, "the endpoint has no /tokenize")
    want, against = ref.tokens, ref.tokens_source
    if want is None:
        want, against = (first.get("probe_tokens"),
                         f"its own rendering when the watch began, since {ref.tokens_source}")
    if want is None:
        return Check("rendering", NOT_CHECKED, f"nothing to compare with: {ref.tokens_source}")
    if served.tokens != want:
        return Check("rendering", CHANGED, f"the endpoint renders the probe conversation to {len(served.tokens)} "
                     f"tokens, {len(want)} with {against}, first different at token "
                     f"{first_difference(served.tokens, want)}: its tokenizer or chat template changed")
    return Check("rendering", SAME, f"the probe renders as with {against}")


def _config_check(ref: Reference, served: Served) -> Check:
    if served.config_hash is None:
        return Check("config", NOT_CHECKED, served.config_note)
    if served.config_hash != ref.config_hash:
        return Check("config", CHANGED, f"the served weights' config hashes to {served.config_hash} "
                                        f"({served.config_note}), the drafter was trained on {ref.config_hash}")
    return Check("config", SAME, f"config hash {served.config_hash} ({served.config_note})")


def target_checks(ref: Reference, served: Served, first: dict[str, Any]) -> list[Check]:
    """The model, rendering and config checks of one reading; `first` is what the endpoint showed when the watch
    first ran ({"models", "tokens"}; {} before that)."""
    return [_model_check(ref, served, first), _rendering_check(ref, served, first), _config_check(ref, served)]

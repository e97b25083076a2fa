"""The ONE render function: conversation → (input_ids, loss_mask) with the target's own chat template.

Loss mask: system / user / template scaffolding tokens 0; every assistant turn's reasoning + content + its
end-of-turn token 1. Masks are assigned by character spans of the fully rendered text (tokenized once with
offsets), so BPE merges at turn boundaries cannot shift them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # {"role": ..., "content": ..., "reasoning_content"?: ...}


class RenderError(ValueError):
    pass


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


def _template_message(message: Message, template: str) -> Message:
    """Messages as the template wants them. Templates that know `reasoning_content` (Qwen3 and kin) render it
    themselves; for the others the reasoning goes in front of the answer inside <think> tags."""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "assistant" and reasoning:
        if "reasoning_content" in template:
            out["reasoning_content"] = reasoning
        else:
            out["content"] = f"<think>\n{reasoning}\n</think>\n\n{out['content']}"
    return out


def _render_text(tokenizer, messages: list[Message], template_kwargs: dict, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def render_conversation(
    tokenizer, messages: list[Message], template_kwargs: dict | None = None, max_length: int | None = None
) -> Rendered:
    """Render with the chat template and mark the tokens the drafter learns (see module docstring)."""
    template_kwargs = template_kwargs or {}
    template = tokenizer.chat_template or ""
    if not template:
        raise RenderError("tokenizer has no chat template")
    msgs = [_template_message(m, template) for m in messages]
    text = _render_text(tokenizer, msgs, template_kwargs, generation_prompt=False)
    eot = tokenizer.eos_token or ""

    # Character spans of assistant turns: [end of the prompt up to this turn, end of the turn's end-of-turn token].
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = _render_text(tokenizer, msgs[:i], template_kwargs, generation_prompt=True)
        through = _render_text(tokenizer, msgs[: i + 1], template_kwargs, generation_prompt=False)
        if not text.startswith(before) or not text.startswith(through):
            raise RenderError(
                f"chat template does not render turn {i} as a prefix of the conversation; "
                "its assistant span cannot be located"
            )
        start, end = len(before), len(through)
        cut = text.rfind(eot, start, end) if eot else -1
        spans.append((start, cut + len(eot) if cut >= 0 else end))

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = enc["input_ids"]
    mask = [0] * len(ids)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(s <= a < e for s, e in spans):
            mask[t] = 1
    if max_length is not None and len(ids) > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
    return Rendered(input_ids=ids, loss_mask=mask, text=text)


def render_prompt_text(tokenizer, messages: list[Message], template_kwargs: dict | None = None) -> str:
    """A conversation up to and including the assistant generation prompt, as text."""
    template = tokenizer.chat_template or ""
    if not template:
        raise RenderError("tokenizer has no chat template")
    msgs = [_template_message(m, template) for m in messages]
    return _render_text(tokenizer, msgs, template_kwargs or {}, generation_prompt=True)


def render_prompt(tokenizer, messages: list[Message], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation up to and including the assistant generation prompt: what a serving engine feeds
    the target before it generates (the chat endpoint renders the same text and tokenizes it without specials)."""
    return tokenizer(render_prompt_text(tokenizer, messages, template_kwargs), add_special_tokens=False)["input_ids"]

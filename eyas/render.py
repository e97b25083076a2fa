"""The ONE render function: conversation → training samples (input_ids + loss_mask) with the target's own chat
template, each assistant turn seen exactly as the server saw it when it generated that turn.

The rule (one for every template):
  context_i  the template's rendering of the history before assistant turn i, as the generator sent it (role and
             content only: no reasoning — Qwen3, gpt-oss and kin drop earlier reasoning anyway), plus the
             generation prompt with the job's chat_template_kwargs (e.g. enable_thinking)
  turn_i     what the template renders for turn i (its reasoning + answer + end-of-turn token) after context_i
  A sample is a text that starts with context_i + turn_i for every turn it supervises (loss mask 1 on turn_i, 0
  elsewhere). Turns are placed from the last one back: a turn joins the longest sample that starts with its
  context and turn; otherwise it opens a sample of its own. So a template that renders the history unchanged
  gives one sample per conversation; one that drops or rewrites earlier turns (reasoning kept only after the
  last user turn, a thinking-off generation prompt the history does not repeat) gives one sample per such turn.
Masks are assigned by character spans of each sample's text (tokenized once with offsets), so BPE merges at turn
boundaries cannot shift them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # {"role": ..., "content": ..., "reasoning_content"?: ...}

# How a template names an assistant message's reasoning: Qwen3 and kin `reasoning_content`, gpt-oss `thinking`.
_THINKING_FIELD = re.compile(r"message\.thinking|message\[['\"]thinking['\"]\]|['\"]thinking['\"] in message")


class RenderError(ValueError):
    pass


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


def reasoning_of(message: Message) -> str | None:
    """An assistant message's reasoning, whichever field the server put it in."""
    return message.get("reasoning_content") or message.get("reasoning")


def served_history(messages: list[Message]) -> list[Message]:
    """The history as the generator sends it back to the server: role and content only."""
    return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]


def _template_message(message: Message, template: str) -> Message:
    """The turn being generated as the template renders it: templates that know `reasoning_content` (Qwen3 and kin)
    or `thinking` (gpt-oss) render the reasoning themselves; for the others it goes in front of the answer inside
    <think> tags."""
    reasoning = reasoning_of(message)
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message["role"] == "assistant" and reasoning:
        if "reasoning_content" in template:
            out["reasoning_content"] = reasoning
        elif _THINKING_FIELD.search(template):
            out["thinking"] = reasoning
        else:
            out["content"] = f"<think>\n{reasoning}\n</think>\n\n{out['content']}"
    return out


def _template(tokenizer) -> str:
    template = tokenizer.chat_template or ""
    if not template:
        raise RenderError("tokenizer has no chat template")
    return template


def _render_text(tokenizer, messages: list[Message], template_kwargs: dict, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def _turn(tokenizer, messages: list[Message], i: int, template: str, template_kwargs: dict) -> tuple[str, str, str]:
    """(context_i, turn_i, the rendered conversation through turn i) for the assistant message at index i."""
    history = served_history(messages[:i])
    context = _render_text(tokenizer, history, template_kwargs, generation_prompt=True)
    through = _render_text(tokenizer, history + [_template_message(messages[i], template)], template_kwargs,
                           generation_prompt=False)
    if not through.startswith(context):
        raise RenderError(f"chat template does not render assistant turn {i} after its own generation prompt; "
                          "the tokens the server generated cannot be located")
    eot = tokenizer.eos_token or ""
    cut = through.rfind(eot, len(context)) if eot else -1
    end = cut + len(eot) if cut >= 0 else len(through)
    return context, through[len(context):end], through


def render_conversation(tokenizer, messages: list[Message], template_kwargs: dict | None = None,
                        max_length: int | None = None) -> list[Rendered]:
    """The conversation's training samples, longest first (see the module docstring for the rule); [] when it
    has no assistant turn. `max_length` truncates each sample."""
    template_kwargs = template_kwargs or {}
    template = _template(tokenizer)
    texts: list[str] = []  # one per sample
    spans: list[list[tuple[int, int]]] = []  # character spans of the supervised turns, per sample
    for i in reversed([i for i, m in enumerate(messages) if m["role"] == "assistant"]):
        context, turn, through = _turn(tokenizer, messages, i, template, template_kwargs)
        home = next((s for s, text in enumerate(texts) if text.startswith(context + turn)), None)
        if home is None:
            texts.append(through)
            spans.append([])
            home = len(texts) - 1
        spans[home].append((len(context), len(context) + len(turn)))

    samples = []
    for text, turn_spans in zip(texts, spans, strict=True):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = enc["input_ids"]
        mask = [int(b > a and any(s <= a < e for s, e in turn_spans)) for a, b in enc["offset_mapping"]]
        if max_length is not None and len(ids) > max_length:
            ids, mask = ids[:max_length], mask[:max_length]
        samples.append(Rendered(input_ids=ids, loss_mask=mask, text=text))
    return samples


def render_prompt_text(tokenizer, messages: list[Message], template_kwargs: dict | None = None) -> str:
    """A conversation up to and including the assistant generation prompt, as text (the history as the generator
    sends it)."""
    _template(tokenizer)
    return _render_text(tokenizer, served_history(messages), template_kwargs or {}, generation_prompt=True)


def render_prompt(tokenizer, messages: list[Message], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation up to and including the assistant generation prompt: what a serving engine feeds
    the target before it generates (the chat endpoint renders the same text and tokenizes it without specials)."""
    return tokenizer(render_prompt_text(tokenizer, messages, template_kwargs), add_special_tokens=False)["input_ids"]

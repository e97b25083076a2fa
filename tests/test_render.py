"""The one render function: exactly which tokens the drafter learns (loss mask 1) on real chat templates."""
from __future__ import annotations

import copy

import pytest

from eyas.render import RenderError, render_conversation
from eyas.target import BUNDLED, load_tokenizer

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED)


def _supervised(tok, r) -> list[str]:
    """Decoded runs of consecutive loss-mask-1 tokens."""
    runs, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_smollm2_single_turn(tok):
    r = render_conversation(tok, [{"role": "user", "content": "What is the capital of France?"},
                                  {"role": "assistant", "content": "The capital of France is Paris."}])
    assert _supervised(tok, r) == ["The capital of France is Paris.<|im_end|>"]
    assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"]
    prompt_part = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if not m])
    assert "What is the capital of France?" in prompt_part and "<|im_start|>assistant\n" in prompt_part


def test_smollm2_multi_turn_with_system(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."}]
    r = render_conversation(tok, msgs)
    assert _supervised(tok, r) == ["Hello!<|im_end|>", "Goodbye.<|im_end|>"]
    assert "Be brief." in r.text


def test_reasoning_with_a_think_template(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = THINK_TEMPLATE
    r = render_conversation(tok, [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "reasoning_content": "Two plus two is four.",
                                   "content": "4"}])
    assert _supervised(tok, r) == ["<think>\nTwo plus two is four.\n</think>\n\n4<|im_end|>"]


def test_reasoning_on_a_template_without_reasoning_support(tok):
    r = render_conversation(tok, [{"role": "user", "content": "2+2?"},
                                  {"role": "assistant", "reasoning_content": "Simple sum.", "content": "4"}])
    assert _supervised(tok, r) == ["<think>\nSimple sum.\n</think>\n\n4<|im_end|>"]


def test_truncation_keeps_the_prefix(tok):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three four five"}]
    full = render_conversation(tok, msgs)
    cut = render_conversation(tok, msgs, max_length=len(full.input_ids) - 3)
    assert cut.input_ids == full.input_ids[:-3] and cut.loss_mask == full.loss_mask[:-3]


def test_template_required(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = None
    with pytest.raises(RenderError, match="no chat template"):
        render_conversation(tok, [{"role": "user", "content": "x"}])

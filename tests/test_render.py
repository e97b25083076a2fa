"""The one render function: exactly which tokens the drafter learns (loss mask 1) on real chat templates."""
from __future__ import annotations

import copy

import jinja2
import pytest

from eyas.render import RenderError, render_conversation, render_prompt_text
from eyas.target import BUNDLED, load_tokenizer
from tests.families import FAMILIES, build_tokenizer

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
    [r] = render_conversation(tok, [{"role": "user", "content": "What is the capital of France?"},
                                    {"role": "assistant", "content": "The capital of France is Paris."}])
    assert _supervised(tok, r) == ["The capital of France is Paris.<|im_end|>"]
    assert r.input_ids == tok(r.text, add_special_tokens=False)["input_ids"]
    prompt_part = tok.decode([t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if not m])
    assert "What is the capital of France?" in prompt_part and "<|im_start|>assistant\n" in prompt_part


def test_smollm2_multi_turn_with_system(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Goodbye."}]
    [r] = render_conversation(tok, msgs)  # the history renders as it was served: one sample for both turns
    assert _supervised(tok, r) == ["Hello!<|im_end|>", "Goodbye.<|im_end|>"]
    assert "Be brief." in r.text


def test_reasoning_with_a_think_template(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = THINK_TEMPLATE
    [r] = render_conversation(tok, [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "reasoning_content": "Two plus two is four.",
                                     "content": "4"}])
    assert _supervised(tok, r) == ["<think>\nTwo plus two is four.\n</think>\n\n4<|im_end|>"]


def test_reasoning_on_a_template_without_reasoning_support(tok):
    [r] = render_conversation(tok, [{"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "reasoning_content": "Simple sum.", "content": "4"}])
    assert _supervised(tok, r) == ["<think>\nSimple sum.\n</think>\n\n4<|im_end|>"]


def test_truncation_keeps_the_prefix(tok):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three four five"}]
    [full] = render_conversation(tok, msgs)
    [cut] = render_conversation(tok, msgs, max_length=len(full.input_ids) - 3)
    assert cut.input_ids == full.input_ids[:-3] and cut.loss_mask == full.loss_mask[:-3]


def test_template_required(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = None
    with pytest.raises(RenderError, match="no chat template"):
        render_conversation(tok, [{"role": "user", "content": "x"}])


# --- the families users serve (tests/families.py): each assistant turn is trained in the context the server saw ---

TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "reasoning_content": "Add two and two.", "content": "4"},
             {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "reasoning_content": "Add three and three.", "content": "6"}]
NO_REASONING = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_tok(request):
    return request.param, build_tokenizer(FAMILIES[request.param])


def _turns_as_served(tok, r, messages, kwargs) -> list[tuple[int, str]]:
    """Each supervised run of a sample as (assistant message index, its text), after checking that the sample's
    text before the run is exactly what the server rendered before generating that turn."""
    contexts = {i: render_prompt_text(tok, messages[:i], kwargs) for i, m in enumerate(messages)
                if m["role"] == "assistant"}
    offsets = tok(r.text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    runs, start, end = [], None, None
    for (a, b), m in zip([*offsets, (len(r.text), len(r.text))], [*r.loss_mask, 0], strict=True):
        if m:
            start, end = a if start is None else start, b
        elif start is not None:
            # the context ends where the run starts (up to whitespace a word-level vocabulary has no token for)
            [turn] = [i for i, c in contexts.items()
                      if r.text.startswith(c) and len(c) <= start and not r.text[len(c):start].strip()]
            runs.append((turn, r.text[start:end]))
            start = None
    return runs


def test_each_turn_is_trained_in_the_context_the_server_saw(family_tok):
    name, tok = family_tok
    kwargs = {"enable_thinking": True} if name.startswith("qwen3") else {}
    samples = render_conversation(tok, TWO_TURNS, kwargs)
    turns = sorted(t for r in samples for t in _turns_as_served(tok, r, TWO_TURNS, kwargs))
    assert [i for i, _ in turns] == [2, 4]  # every assistant turn, once
    for i, text in turns:  # loss on the turn's reasoning + answer + end of turn
        assert TWO_TURNS[i]["reasoning_content"] in text and text.endswith(TWO_TURNS[i]["content"] + tok.eos_token)
    # the history drops earlier reasoning in every one of these templates (the generator never sends it back), so
    # the first turn, generated with its reasoning, is a sample of its own
    assert len(samples) == 2 and len(samples[0].input_ids) > len(samples[1].input_ids)
    assert "Add two and two." not in samples[0].text


def test_without_reasoning(family_tok):
    name, tok = family_tok
    samples = render_conversation(tok, NO_REASONING)
    turns = sorted(t for r in samples for t in _turns_as_served(tok, r, NO_REASONING, {}))
    assert [i for i, _ in turns] == [2, 4]
    if name == "llama3":  # the history renders each turn as it was generated: one sample for both
        assert len(samples) == 1
        assert [t for _, t in turns] == ["4<|eot_id|>", "6<|eot_id|>"]
    elif name == "mistral":  # so does Mistral's: the system prompt stays in the first user turn
        assert len(samples) == 1
        assert [t for _, t in turns] == ["4</s>", "6</s>"]
    elif name.startswith("qwen3"):  # thinking on: the turn opens with its (empty) think block, the history does not
        assert len(samples) == 2 and [t for _, t in turns] == [
            "<think>\n\n</think>\n\n4<|im_end|>", "<think>\n\n</think>\n\n6<|im_end|>"]
    else:  # gpt-oss: a turn that ends the conversation ends with <|return|>, in the history with <|end|>
        assert len(samples) == 2
        assert [t for _, t in turns] == ["<|channel|>final<|message|>4<|return|>",
                                         "<|channel|>final<|message|>6<|return|>"]


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_qwen3_thinking_off(name):
    """enable_thinking=false: the empty think block is the server's generation prompt (context, loss 0); the turn
    the target generates is the answer alone."""
    tok = build_tokenizer(FAMILIES[name])
    kwargs = {"enable_thinking": False}
    samples = render_conversation(tok, NO_REASONING, kwargs)
    turns = sorted(t for r in samples for t in _turns_as_served(tok, r, NO_REASONING, kwargs))
    assert turns == [(2, "4<|im_end|>"), (4, "6<|im_end|>")]
    assert all(render_prompt_text(tok, NO_REASONING[:i], kwargs).endswith("<think>\n\n</think>\n\n")
               for i in (2, 4))
    # reasoning in a conversation generated with thinking off: no server renders it that way
    with pytest.raises(RenderError, match="turn 4"):
        render_conversation(tok, TWO_TURNS, kwargs)


def test_gpt_oss_reasoning_goes_to_the_analysis_channel():
    tok = build_tokenizer(FAMILIES["gpt-oss"])
    first, _ = render_conversation(tok, TWO_TURNS, {"reasoning_effort": "low"})
    assert "Reasoning: low" in first.text
    assert [t for _, t in _turns_as_served(tok, first, TWO_TURNS, {"reasoning_effort": "low"})] == [
        "<|channel|>analysis<|message|>Add three and three.<|end|><|start|>assistant<|channel|>final<|message|>6"
        "<|return|>"]


# Mistral-7B-Instruct-v0.1's template: no system role (it raises on one), no space before an answer, one after eos
MISTRAL_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def _tokens(tok, r) -> list[tuple[str, int]]:
    return list(zip(tok.convert_ids_to_tokens(r.input_ids), r.loss_mask, strict=True))


def test_mistral_inst_turns_system_folded_into_the_first_user_turn():
    """[INST] turns: every prompt token (bos, [INST] … [/INST], the system prompt the template folds into the first
    user turn) 0; each answer and its </s> 1; both turns one sample, since the history renders them as generated."""
    tok = build_tokenizer(FAMILIES["mistral"])
    [sample] = render_conversation(tok, NO_REASONING)
    assert sample.text == ("<s> [INST] Be brief.\n\nWhat is 2+2? [/INST] 4</s> [INST] And 3+3? [/INST] 6</s>")
    assert [t for t, m in _tokens(tok, sample) if m] == ["4", "</s>", "6", "</s>"]
    tokens = [t for t, _ in _tokens(tok, sample)]
    assert tokens[:4] == ["<s>", "[INST]", "Be", "brief."] and tokens.count("[/INST]") == 2
    # the server's prompt for the second turn is the sample up to its answer
    assert sample.text.startswith(render_prompt_text(tok, NO_REASONING[:4]))


def test_mistral_older_template_without_a_system_role():
    """v0.1's template: the same masks without a system message (the space after </s> belongs to the next prompt);
    a conversation with one is refused by the template itself, never rendered with the system prompt lost."""
    tok = build_tokenizer(FAMILIES["mistral"])
    tok.chat_template = MISTRAL_V01_TEMPLATE
    [sample] = render_conversation(tok, NO_REASONING[1:])
    assert sample.text == "<s>[INST] What is 2+2? [/INST]4</s> [INST] And 3+3? [/INST]6</s> "
    assert [t for t, m in _tokens(tok, sample) if m] == ["4", "</s>", "6", "</s>"]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render_conversation(tok, NO_REASONING)


def test_mistral_v03_template_refuses_a_system_prompt_folded_into_the_last_user_turn():
    """v0.3's template puts the system prompt in the last user turn: the prompt each turn was generated after is
    then no prefix of the conversation, so the renderer refuses it (the extractor counts it unrenderable) rather than
    train an answer in a context the server never sent; without a system message it renders as v0.2's."""
    tok = build_tokenizer(FAMILIES["mistral"])
    tok.chat_template = tok.chat_template.replace("loop.first and system_message", "loop.last and system_message")
    assert "[INST] Be brief.\n\nAnd 3+3? [/INST]" in render_prompt_text(tok, NO_REASONING[:4])
    with pytest.raises(RenderError, match="turn 4"):
        render_conversation(tok, NO_REASONING)
    [sample] = render_conversation(tok, NO_REASONING[1:])
    assert [t for t, m in _tokens(tok, sample) if m] == ["4", "</s>", "6", "</s>"]

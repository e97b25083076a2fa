"""Greedy chain speculative decoding in-process: the real target (HF, KV cache) verifies K drafter tokens per forward.

One round at context x_0..x_{n-1} (the target has processed x_0..x_{n-2} and holds their aux states g_0..g_{n-2}):
  draft step 0   rows t = 0..n-2 feed (g_t, x_{t+1}) at position t, causal; the last row proposes d_1
  draft step j   feeds (pre-norm hidden of step j-1, d_j) at position n-2+j and attends to the step-0 keys plus
                 its own same-index keys (eyas.drafter.TTTCache), proposing d_{j+1}
  verify         the target runs [x_{n-1}, d_1..d_K] once; d_i is accepted while it equals the target's argmax,
                 then the target's own next token (the bonus) is appended; the aux states of the accepted rows
                 extend g, and the KV cache is cropped to the accepted prefix.
This is vLLM's chain proposer (docs/eagle3.md §6.1) and its counting (docs/eagle3.md §6.3): every verify round is one
draft, accepted
tokens are counted before stop/max_tokens truncation, τ = 1 + accepted / drafts, and per-position acceptance is
accepted_at_pos_i / drafts. The output must equal the target's plain greedy decoding; `measure_acceptance` runs
both, and records where they first differ with the target's logits for both tokens there: in bf16 a near tie can
rank two tokens differently in the verify and the plain forward (recorded as such), anything else is a mismatch.
Inputs go to the target's input device; the drafter sits there, and the hooked aux states are gathered there.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from eyas.capture import gather, hooks
from eyas.decoding import grouped_sdpa, growing_cache
from eyas.drafter import Drafter
from eyas.methods import method_of_drafter
from eyas.prompts import load_eval_prompts
from eyas.render import render_prompt
from eyas.settings import Settings
from eyas.target import Target


@dataclass
class PromptIds:
    id: str
    ids: list[int]
    category: str | None = None  # the prompt file's `category` (MT-bench's), for τ per category


def eval_prompts(tokenizer, source: str = "bundled:mt_bench", limit: int | None = None,
                 template_kwargs: dict | None = None, settings: Settings | None = None) -> list[PromptIds]:
    """Each prompt's first user turn (after its system prompt, if any), rendered with the chat template (and the
    kwargs the drafter's data was rendered with, e.g. enable_thinking) and the assistant generation prompt. The
    default, MT-bench, is held out from training by the generator; an s3:// source is read with `settings`."""
    prompts = load_eval_prompts(source, limit, settings)
    return [PromptIds(p.id, render_prompt(tokenizer, ([{"role": "system", "content": p.system}] if p.system else [])
                                          + [{"role": "user", "content": p.user_turns[0]}], template_kwargs),
                      p.meta.get("category"))
            for p in prompts]


def stop_ids(target: Target) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS plus the generation config's (what vLLM stops on)."""
    ids = {target.tokenizer.eos_token_id}
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return {int(i) for i in ids if i is not None}


@dataclass
class Decoded:
    tokens: list[int]  # new tokens, truncated at the first stop token (kept) or max_new_tokens
    drafts: int = 0  # verify rounds (each proposes K tokens)
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forwards: int = 0
    seconds: float = 0.0

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_pos)


def _finished(tokens: list[int], stop: set[int], max_new_tokens: int) -> bool:
    return len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in stop)


def _extend(out: list[int], new: list[int], stop: set[int], max_new_tokens: int) -> None:
    for t in new:
        if _finished(out, stop, max_new_tokens):
            return
        out.append(t)


Check = Callable[[], None]  # runs between steps; raises to stop them (a cancel: eyas.stage.StageContext.check)


def _no_check() -> None:
    pass


@torch.inference_mode()
def speculate(target: Target, drafter: Drafter, aux_layers: tuple[int, ...], prompt: list[int], k: int,
              max_new_tokens: int, stop: set[int], check: Check = _no_check) -> Decoded:
    """`check()` runs before each round."""
    from transformers import DynamicCache

    t0 = time.perf_counter()
    model = target.model
    on = drafter.fc.weight.device  # the target's input device: its inputs and the drafter's both go there
    cache = DynamicCache(config=model.config)
    res = Decoded(tokens=[], accepted_per_pos=[0] * k)
    with hooks(target, aux_layers) as got:
        def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            ids_t = torch.tensor([ids], device=on)
            logits = model(input_ids=ids_t, past_key_values=cache, use_cache=True).logits[0]
            res.target_forwards += 1
            return logits.argmax(-1), gather(got, aux_layers, on)[0]

        preds, aux = forward(prompt)
        # A hybrid target's linear-attention layers keep a recurrent state that crop cannot roll back (it cuts only
        # keys/values): there a copy from before each verification, advanced over the accepted tokens, replaces it
        croppable = cache.is_croppable
        context = prompt + [int(preds[-1])]
        _extend(res.tokens, context[-1:], stop, max_new_tokens)
        method = method_of_drafter(drafter)
        # what the drafter keeps of every row the target has processed (EAGLE-3: fc(g), [1, n-1, H]; DFlash: g)
        h0 = method.context_states(drafter, aux[None])
        past = None  # what the drafter kept of its last drafting (EAGLE-3: its step-0 keys/values so far)
        while not _finished(res.tokens, stop, max_new_tokens):
            check()
            drafts, past = method.propose(drafter, h0, context, k, past)
            before = None if croppable else copy.deepcopy(cache)
            preds, aux = forward(context[-1:] + drafts)
            a = 0
            while a < k and drafts[a] == int(preds[a]):
                a += 1
            res.drafts += 1
            for i in range(a):
                res.accepted_per_pos[i] += 1
            emitted = drafts[:a] + [int(preds[a])]
            if a < k and before is None:
                cache.crop(-(k - a))  # keep x_{n-1} and the accepted drafts
            elif a < k:
                cache = before
                model.model(input_ids=torch.tensor([context[-1:] + drafts[:a]], device=on), past_key_values=cache,
                            use_cache=True)
            h0 = torch.cat([h0, method.context_states(drafter, aux[None, : a + 1])], dim=1)
            context += emitted
            _extend(res.tokens, emitted, stop, max_new_tokens)
    res.seconds = time.perf_counter() - t0
    return res


class _Checked(StoppingCriteria):
    """`check()` after each of `generate`'s decoding steps; it stops no sequence itself (it raises to stop)."""

    def __init__(self, check: Check):
        self.check = check

    def __call__(self, input_ids: torch.Tensor, *_args, **_kwargs) -> torch.Tensor:
        self.check()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.inference_mode()
def greedy(target: Target, prompts: list[list[int]], max_new_tokens: int, stop: set[int],
           batch: int = 32, check: Check = _no_check) -> list[list[int]]:
    """The target's plain greedy decoding (transformers `generate`), the reference the output must equal.
    Prompts go in left-padded batches: on a CPU each forward streams every weight, so one batch of 32 takes about
    three quarters of the time of two of 16 (2 cores); the cache grows in place and grouped heads are read in place
    (eyas.decoding). `check()` runs after each decoding step."""
    pad = sorted(stop)[0]
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=target.input_device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=target.input_device)
        with grouped_sdpa(target.model):
            out = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False, temperature=None, top_p=None, top_k=None,
                                        eos_token_id=sorted(stop), pad_token_id=pad,
                                        past_key_values=growing_cache(target.model.config, width + max_new_tokens),
                                        stopping_criteria=StoppingCriteriaList([_Checked(check)]))
        for row in out[:, width:].tolist():
            tokens: list[int] = []
            _extend(tokens, row, stop, max_new_tokens)
            outs.append(tokens)
    return outs


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# Two logits whose gap is at most this share of the larger magnitude are a near tie: bf16 keeps 8 significant
# bits, so the batched greedy forward and the verify forward over [x_{n-1}, d_1..d_K] can rank them differently
# without either being wrong. A wider gap is a real disagreement (a bug in the decoding or the caching).
NEAR_TIE = 2 ** -6


@torch.inference_mode()
def divergence(target: Target, prompt: list[int], speculative: list[int], reference: list[int],
               position: int) -> dict:
    """Where speculative and greedy output first differ: both tokens and the target's logits for them there,
    from one plain forward over the prompt and the common prefix (a missing token: that output had ended)."""
    ids = torch.tensor([prompt + reference[:position]], device=target.input_device)
    logits = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()  # [V]
    picked = {}
    for name, tokens in (("speculative", speculative), ("greedy", reference)):
        token = tokens[position] if position < len(tokens) else None
        picked[name] = {"token": token, "logit": None if token is None else float(logits[token])}
    a, b = picked["speculative"]["logit"], picked["greedy"]["logit"]
    near = a is not None and b is not None and abs(a - b) <= NEAR_TIE * max(abs(a), abs(b))
    return {"position": position, **picked, "near_tie": near}


def measure_acceptance(target: Target, drafter: Drafter, aux_layers: tuple[int, ...], prompts: list[PromptIds], k: int,
             max_new_tokens: int, progress=None, references: list[list[int]] | None = None,
             check: Check = _no_check) -> dict:
    """Speculative and plain greedy decoding of every prompt; acceptance in vLLM's definitions, and equality.
    `references`: the prompts' plain greedy outputs when the caller has them (else decoded here). `check()` runs
    between decoding steps."""
    stop = stop_ids(target)
    drafts, per_pos, spec_tokens, spec_s, forwards = 0, [0] * k, 0, 0.0, 0
    records = []
    if references is None:
        references = greedy(target, [p.ids for p in prompts], max_new_tokens, stop, check=check)
    for i, (p, ref) in enumerate(zip(tqdm(prompts, desc="evaluate", unit="prompt"), references, strict=True)):
        spec = speculate(target, drafter, aux_layers, p.ids, k, max_new_tokens, stop, check)
        diff = first_difference(spec.tokens, ref)
        records.append({"id": p.id, "prompt_tokens": len(p.ids), "tokens": len(spec.tokens), "drafts": spec.drafts,
                        "accepted": spec.accepted, "accepted_per_pos": spec.accepted_per_pos,
                        "matches_greedy": diff is None, "first_difference": diff, "output": spec.tokens,
                        "divergence": None if diff is None else divergence(target, p.ids, spec.tokens, ref, diff)})
        drafts += spec.drafts
        per_pos = [x + y for x, y in zip(per_pos, spec.accepted_per_pos, strict=True)]
        spec_tokens, spec_s, forwards = (spec_tokens + len(spec.tokens), spec_s + spec.seconds,
                                         forwards + spec.target_forwards)
        if progress is not None:
            progress(i + 1, len(prompts))
    accepted = sum(per_pos)
    diverged = [r for r in records if r["divergence"] is not None]
    # near ties are recorded (position, both logits), not hidden; every other difference is a mismatch
    mismatches = [r["id"] for r in diverged if not r["divergence"]["near_tie"]]
    near_ties = [{"id": r["id"], **r["divergence"]} for r in diverged if r["divergence"]["near_tie"]]
    return {
        "k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "drafts": drafts, "accepted": accepted, "accepted_per_pos": per_pos,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [x / drafts if drafts else None for x in per_pos],
        "tokens": spec_tokens, "target_forwards": forwards,
        "matches_greedy": not diverged, "greedy_mismatches": mismatches, "near_ties": near_ties,
        "speculative_tok_s": spec_tokens / spec_s if spec_s else None,  # in-process, one stream (not serving)
        "per_prompt": records,
    }

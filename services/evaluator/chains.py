"""Per-position acceptance of a greedy K-token chain for every K ≤ K_max, from one teacher-forced pass.

In a greedy chain the drafts proposed from a context do not depend on K (draft i depends on the context and drafts
1..i-1 only), so from every context s of the target's greedy output we can measure the run length a(s): how many of
K_max drafts the target accepts from there. A K-chain then runs rounds exactly as vLLM does: start at s, accept
min(a(s), K), emit those plus the bonus token, continue at s + min(a(s), K) + 1. The rounds differ between K (a
K = 7 run visits other contexts than a K = 3 run), so acceptance of a K_max run truncated to K is NOT the K-chain's;
replaying the run lengths is (tests/test_evaluator.py compares it with services.evaluator.specdec for K = 1..3).

The pass (shapes for one prompt of P tokens with output O, N = P + O, T = N - 1 drafter rows):
  target     one forward over the N tokens: aux states g [1, N, n_aux·H_t], greedy next tokens preds [N]
  draft 0    rows t = 0..T-1 feed (g_t, x_{t+1}) causally (as eyas.drafter.chain_drafts does for a context
             ending at t+1); row t proposes the token after x_{t+1}, compared with preds[t+1]
  draft j    row t feeds (its pre-norm state of step j-1, preds[t+j]) at position t+j, attending to step-0 keys
             ≤ t and its own keys of steps 1..j (eyas.drafter.TTTCache): while every earlier draft was accepted it
             equals preds[t+j], so this is the real chain exactly as long as it matters (a parallel drafter,
             P-EAGLE, feeds its mask token and state instead: Drafter.feed; its drafts do not depend on K either)
  beyond     the output's last round may draft past its end (past max_new_tokens or a stop token): live decoding
             checks those drafts against the target's next greedy tokens and counts them before truncating, so the
             target continues greedily for k_max − 1 tokens past the end (KV cache, one token per forward) and the
             last rounds are checked against them too. The replay then counts exactly what live decoding counts.
"""
from __future__ import annotations

from typing import Any

import torch

from eyas.capture import gather, hooks
from eyas.methods import method_of_drafter
from eyas.target import Target


@torch.inference_mode()
def target_pass(target: Target, aux_layers: tuple[int, ...], ids: torch.Tensor,
                k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [1, N] (on the drafter's device) → aux states [1, N, n_aux·H_t], and preds [N + k_max - 1]: the target's
    greedy token after each prefix ids[:m+1], continued greedily k_max - 1 tokens past the end."""
    on = ids.device
    with hooks(target, aux_layers) as got:
        out = target.model(input_ids=ids, use_cache=True)
        aux = gather(got, aux_layers, on)
    preds = [out.logits[0].argmax(-1)]
    cache = out.past_key_values
    for _ in range(k_max - 1):  # one token per forward, from the KV cache
        nxt = target.model(input_ids=preds[-1][-1:][None], past_key_values=cache, use_cache=True)
        preds.append(nxt.logits[0, -1:].argmax(-1))
    return aux, torch.cat(preds).to(on)


def drafter_runs(drafter: Any, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor, prompt_len: int,
                 k_max: int) -> list[int]:
    """a(s) for every round start s of the output ids[0, prompt_len:], from the target pass's aux and preds, as the
    drafter's method replays them (EAGLE-3: the chain, eyas.drafter.chain_runs; DFlash: its block's K = block − 1
    tokens whatever k_max is, eyas.dflash.block_runs)."""
    return method_of_drafter(drafter).replay_runs(drafter, ids, aux, preds, prompt_len, k_max)


def run_lengths(target: Target, drafter: Any, aux_layers: tuple[int, ...], prompt: list[int],
                output: list[int], k_max: int) -> list[int]:
    """a(s) for s = 0..len(output)-1: drafts (of k_max) the target accepts from context prompt + output[:s]."""
    ids = torch.tensor([prompt + output], device=drafter.fc.weight.device)  # [1, N]
    aux, preds = target_pass(target, aux_layers, ids, k_max)
    return drafter_runs(drafter, ids, aux, preds, len(prompt), k_max)


def replay(runs: list[list[int]], ks: list[int]) -> dict[int, dict]:
    """K → chain acceptance for each K of `ks` (the drafter's method's drafted_ks) over the same run lengths."""
    return {k: chain_acceptance(runs, k) for k in ks}


def drafted_ks(drafter: Any, k_max: int) -> list[int]:
    """The K a replay of this drafter's runs measures, as its method says: every K ≤ k_max for a chain or P-EAGLE
    (draft i does not depend on K), only its block's K for DFlash."""
    return method_of_drafter(drafter).drafted_ks(drafter, k_max)


def chain_acceptance(runs: list[list[int]], k: int) -> dict:
    """Replay K-chains over each prompt's run lengths (round 1 starts after the prefill's token, s = 1); returns
    drafts, accepted per position, τ and per-position acceptance in vLLM's definitions."""
    drafts, per_pos = 0, [0] * k
    for run in runs:
        s = 1
        while s < len(run):
            a = min(run[s], k)
            drafts += 1
            for i in range(a):
                per_pos[i] += 1
            s += a + 1
    return {"k": k, "drafts": drafts, "accepted_per_pos": per_pos,
            "acceptance_length": 1 + sum(per_pos) / drafts if drafts else None,
            "per_position_acceptance": [x / drafts if drafts else 0.0 for x in per_pos]}

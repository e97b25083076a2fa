"""Per-position acceptance of a greedy K-token chain for every K ≤ K_max, from one teacher-forced pass.

In a greedy chain the drafts proposed from a context do not depend on K (draft i depends on the context and drafts
1..i-1 only), so from every context s of the target's greedy output we can measure the run length a(s): how many of
K_max drafts the target accepts from there. A K-chain then runs rounds exactly as vLLM does: start at s, accept
min(a(s), K), emit those plus the bonus token, continue at s + min(a(s), K) + 1. The rounds differ between K (a
K = 7 run visits other contexts than a K = 3 run), so acceptance of a K_max run truncated to K is NOT the K-chain's;
replaying the run lengths is (tests/test_evaluator.py compares it with services.evaluator.specdec for K = 1..3).

The pass (shapes for one prompt of P tokens with output O, N = P + O, T = N - 1 drafter rows):
  target     one forward over the N tokens: aux states g [1, N, n_aux·H_t], greedy next tokens preds [N]
  draft 0    rows t = 0..T-1 feed (g_t, x_{t+1}) causally (as specdec._draft does for a context ending at t+1);
             row t proposes the token after x_{t+1}, compared with preds[t+1]
  draft j    row t feeds (its pre-norm state of step j-1, preds[t+j]) at position t+j, attending to step-0 keys
             ≤ t and its own keys of steps 1..j (eyas.drafter.TTTCache): while every earlier draft was accepted it
             equals preds[t+j], so this is the real chain exactly as long as it matters
A draft past the last known prediction (the end of the output) counts as rejected: the last round of a prompt may
accept slightly less than in live decoding.
"""
from __future__ import annotations

import torch

from eyas.capture import gather, hooks
from eyas.drafter import Drafter, TTTCache
from eyas.target import Target


@torch.inference_mode()
def run_lengths(target: Target, drafter: Drafter, aux_layers: tuple[int, ...], prompt: list[int],
                output: list[int], k_max: int) -> list[int]:
    """a(s) for s = 0..len(output)-1: drafts (of k_max) the target accepts from context prompt + output[:s]."""
    on = drafter.fc.weight.device
    ids = torch.tensor([prompt + output], device=on)  # [1, N]
    with hooks(target, aux_layers) as got:
        preds = target.model(input_ids=ids).logits[0].argmax(-1)  # [N]: the target's token after ids[:m+1]
        aux = gather(got, aux_layers, on)  # [1, N, n_aux·H_t]
    n = ids.shape[1]
    rows = n - 1
    pos = torch.arange(rows, device=on)[None]  # [1, T]
    cache = TTTCache()
    hidden = drafter.step(ids[:, 1:], drafter.project(aux[:, :rows]), pos, cache)  # [1, T, H]
    run = torch.zeros(rows, dtype=torch.long, device=on)  # accepted so far per row
    alive = torch.ones(rows, dtype=torch.bool, device=on)  # every draft so far accepted
    for j in range(k_max):
        if j:
            fed = torch.full((rows,), int(preds[-1]), device=on)
            fed[: n - j] = preds[j: n][:rows]  # row t feeds preds[t+j] (past the end: never read, see `known`)
            hidden = drafter.step(fed[None], hidden, pos + j, cache)
        draft = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))[0]  # [T]: row t's draft j+1
        known = torch.arange(rows, device=on) + 1 + j < n  # preds[t+1+j] exists
        check = torch.zeros(rows, dtype=torch.bool, device=on)
        check[known] = draft[known] == preds[1 + j:][: int(known.sum())]
        alive &= check
        run += alive.long()
    # round start s (context prompt + output[:s]) is the row ending at its last token: t = P + s - 2
    return run[len(prompt) - 2: len(prompt) - 2 + len(output)].tolist()


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

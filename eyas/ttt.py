"""Training-time test (docs/eagle3.md §4): one function, used by the trainer for its loss and by the
evaluator for teacher-forced per-position accuracy on validation features.

For a sequence x_0..x_{T-1} with aux features g_t, final post-norm target states y_t and loss mask l_t,
TTT step k = 0..K-1 at index t:
  token     x_{t+1+k}                          (ground truth, teacher forcing: shifted left one more per step)
  hidden    fc(g_t) at k = 0, else the drafter's pre-norm output of step k-1 at index t
            (P-EAGLE, k ≥ 1: the mask token and fc(mask_hidden) in place of token and hidden; Drafter.feed)
  position  t + k                              (RoPE)
  attention step-0 keys causally (indices ≤ t) + the key of each step 1..k at index t (Drafter/TTTCache)
  label     p = softmax over the draft vocabulary of y_{t+1+k} @ lm_head^T restricted to t2d ids (renormalized)
  mask      l_{t+k} · t2d[argmax_full-vocab(y_{t+1+k} @ lm_head^T)] · [t+1+k < length]
            (packed rows: · [t+1+k in t's sample]; positions and step-0 attention restart at each sample)
  loss      soft cross-entropy −Σ_v p_v log q_v, q = softmax(draft logits)
  accuracy  argmax q == argmax p (both in draft vocabulary space) over masked positions
Objective: Σ_k decay^k · Σ_masked CE_k / N, N = the number of masked step-0 positions (`TTTResult.denom`).
Positions whose label would lie past the sequence end carry no loss (speculators trims them; SpecForge pads them
with uniform labels, which carry no signal).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eyas.batching import Batch
from eyas.drafter import Drafter, TTTCache

TOP_CHUNK = 1024  # rows of full-vocabulary target logits computed at once (V floats each)


@torch.no_grad()
def target_top(final_hidden: torch.Tensor, lm_head: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Full-vocabulary argmax of the target's logits `final_hidden @ lm_head^T`, in chunks of TOP_CHUNK rows.

    final_hidden [..., H], lm_head [V, H] → [...] int64. With `rows` (a bool mask shaped like final_hidden[..., 0])
    only those rows are computed; the others are 0.
    """
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.zeros(flat.shape[0], dtype=torch.int64, device=flat.device)
    want = torch.arange(flat.shape[0], device=flat.device)
    if rows is not None:
        want = want[rows.reshape(-1)]
    w = lm_head.to(flat.device, torch.float32)
    for i in range(0, want.numel(), TOP_CHUNK):
        idx = want[i: i + TOP_CHUNK]
        out[idx] = (flat[idx].float() @ w.T).argmax(-1)
    return out.view(final_hidden.shape[:-1])


def label_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions s whose target distribution some TTT step uses under a nonzero mask: l_{s-1} = 1."""
    rows = torch.zeros_like(loss_mask, dtype=torch.bool)
    rows[..., 1:] = loss_mask[..., :-1].bool()
    return rows


@dataclass
class TTTResult:
    objective: torch.Tensor  # scalar, Σ_k decay^k · ce_sum[k] (differentiable; divide by a denominator)
    denom: torch.Tensor  # number of masked positions at step 0
    ce_sum: torch.Tensor  # [K] summed soft cross-entropy over masked positions
    correct: torch.Tensor  # [K] masked positions where draft argmax == target argmax
    count: torch.Tensor  # [K] masked positions per step

    @property
    def loss(self) -> torch.Tensor:
        """The objective averaged over this batch's masked step-0 positions."""
        return self.objective / self.denom.clamp(min=1)


def _head_loss(drafter: Drafter, hidden: torch.Tensor, label: torch.Tensor,
               label_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H] of the masked positions, label [N, Vd] → (soft cross-entropy summed, correct argmax count)."""
    logits = drafter.logits(hidden).float()  # [N, Vd]
    ce_sum = -(label * F.log_softmax(logits, dim=-1)).sum()
    return ce_sum, (logits.detach().argmax(-1) == label_top).sum().float()


def _rows(batch: Batch, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Positions [B, T], and for packed rows the token's sample [B, T] and the step-0 attention mask [B, 1, T, T]
    (causal inside each sample), so that each sample sees only itself, from its own position 0."""
    B, T = batch.input_ids.shape
    if batch.segments is None or batch.positions is None:  # (collate_rows sets both or neither)
        return torch.arange(T, device=device)[None, :].expand(B, T), None, None
    segments = batch.segments.to(device)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return batch.positions.to(device), segments, (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def ttt_forward(drafter: Drafter, batch: Batch, target_lm_head: torch.Tensor, steps: int,
                decay: float = 0.8, recompute: bool = False) -> TTTResult:
    """Run `steps` TTT steps of `drafter` over `batch` (docs/eagle3.md §4) and return the loss terms and accuracy
    counts.

    drafter: an EAGLE-3 Drafter whose d2t/t2d are set; its parameter dtype is the compute dtype.
    batch: right-padded features (eyas.batching.Batch); `batch.target_top`, if set, is the precomputed
        full-vocabulary target argmax (else computed here, chunked, on the rows that need it).
    target_lm_head: the target's lm_head weight [V, H] (frozen).
    recompute: keep no draft-vocabulary logits for the backward pass (N×Vd floats per step, the largest
        activations) but recompute them there (activation checkpointing): the same loss and gradients.
    Call under torch.no_grad() for evaluation; correct / count per step is the per-position accuracy.
    """
    device = drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    B, T = batch.input_ids.shape
    ids, lmask = batch.input_ids.to(device), batch.loss_mask.to(device)
    valid = torch.arange(T, device=device)[None, :] < batch.lengths.to(device)[:, None]  # [B, T]
    vd = drafter.cfg.draft_vocab_size
    used = torch.arange(vd, device=device) + drafter.d2t  # draft id → target id

    with torch.no_grad(), torch.autocast(device.type, enabled=False):  # labels in fp32 even under bf16 autocast
        y = batch.final_hidden.to(device, torch.float32)
        top = batch.target_top
        if top is None:
            top = target_top(y, target_lm_head, label_rows(lmask) & valid)
        top = top.to(device)
        usable = drafter.t2d[top] & valid  # [B, T]: label position whose target top-1 is draftable
        w_draft = target_lm_head.to(device, torch.float32)[used]  # [Vd, H]
        p = torch.softmax(y @ w_draft.T, dim=-1)  # [B, T, Vd] target distribution on the draft vocabulary
        p_top = p.argmax(-1)  # [B, T]

    hidden = drafter.project(batch.aux_hidden.to(device, dtype))
    positions, segments, within = _rows(batch, device)
    cache = TTTCache(within=within)
    objective = torch.zeros((), device=device)
    ce_sums, corrects, counts = [], [], []
    for k in range(steps):
        s = k + 1  # index t reads token t+s, label t+s
        n = max(T - s, 0)  # indices with a label inside the row
        tokens = torch.zeros_like(ids)
        tokens[:, :n] = ids[:, s:]
        fed, state = drafter.feed(tokens, hidden) if k else (tokens, hidden)
        hidden = drafter.step(fed, state, positions + k, cache)
        mask = lmask[:, k: k + n].bool() & usable[:, s:]  # [B, n]
        if segments is not None:  # the label t+s of another sample is no label of t's
            mask &= segments[:, :n] == segments[:, s:]
        # The lm_head runs only on masked positions (no prompt, no padding): it is the costliest matmul.
        head = (drafter, hidden[:, :n][mask], p[:, s:][mask], p_top[:, s:][mask])
        ce_sum, correct = (checkpoint(_head_loss, *head, use_reentrant=False) if recompute and torch.is_grad_enabled()
                           else _head_loss(*head))
        objective = objective + (decay ** k) * ce_sum
        ce_sums.append(ce_sum.detach())
        corrects.append(correct)
        counts.append(mask.sum().float())
    return TTTResult(objective=objective, denom=counts[0],
                     ce_sum=torch.stack(ce_sums), correct=torch.stack(corrects), count=torch.stack(counts))

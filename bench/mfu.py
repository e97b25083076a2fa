"""Model FLOPs utilisation of drafter training: the FLOPs one trained token costs (counted from the drafter's
shapes, as the PaLM paper counts MFU: matmuls only, backward = 2× forward), and a GPU's dense bf16 peak.

Per real (unpadded) token of a batch, with K TTT steps (eyas.ttt):
  fc              2 · (n_aux·H_t) · H                                   once, trained
  midlayer        2 · (2H·(nh + 2·nkv)·hd + nh·hd·H + 3·H·I)            per step, trained
  attention       2 · 2 · nh·hd · T/2  (QKᵀ and PV over the causal context, T the padded length; the same-index
                  keys of earlier steps add K ≪ T)                       per step, trained
  lm_head         2 · H · Vd   on supervised positions only              per step, trained
  labels          2 · H · Vd   (target distribution on the draft vocabulary, no gradient) once
Trained terms count 3× (forward + backward).
"""
from __future__ import annotations

import torch

from eyas.drafter import DrafterConfig

# Dense bf16 peak FLOP/s by GPU name (the vendors' data sheets, without sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
             "B200": 2250e12, "GH200": 989e12}


def train_flops(cfg: DrafterConfig, steps: int, tokens: int, supervised: int, padded_len: float) -> float:
    """FLOPs of training on `tokens` real tokens (`supervised` of them with a loss) of batches `padded_len` long."""
    h, hd = cfg.hidden_size, cfg.head_dim
    fc = 2 * cfg.num_aux * cfg.target_hidden_size * h
    mid = 2 * (2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
               + cfg.num_attention_heads * hd * h + 3 * h * cfg.intermediate_size)
    attention = 2 * cfg.num_attention_heads * hd * padded_len
    head = 2 * h * cfg.draft_vocab_size
    trained = tokens * (fc + steps * (mid + attention)) + supervised * steps * head
    return 3 * trained + tokens * head


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)

"""The EAGLE-3 drafter, all of it in this file (docs/eagle3.md §1, §2).

    h0 = fc(cat(aux))                                   # [B, T, n_aux·H_t] → [B, T, H], once per sequence
    step(k):  a = cat(input_layernorm(embed(x)), hidden_norm(h))          # [B, T, 2H], embedding first
              h = h + o_proj(attn(a))  ;  h = h + mlp(post_attention_layernorm(h))   # pre-norm state, fed back
              logits = lm_head(norm(h))                 # [B, T, Vd] draft-vocab logits; target id = i + d2t[i]
EAGLE 3.1's optional norms (DrafterConfig.norm_before_fc / fc_norm / norm_output) add an RMSNorm before fc, over
cat(aux) or per aux chunk, and feed norm(h) back instead of h.
P-EAGLE (parallel drafting, DrafterConfig.mask_token_id set) is the same network fed differently: every step after
the first takes the mask token and fc(mask_hidden), a learned [n_aux·H_t] state, instead of the previous draft and
its state (`Drafter.feed`), so no step waits on another and the engine drafts all K in one forward (vLLM's
`"parallel_drafting": true`: the last context slot, then K−1 mask slots at the next positions, causal).

Module names equal the EAGLE/SpecForge checkpoint names, so export is the state dict minus the frozen embedding
(eyas.exports writes and loads the checkpoints).
The attention of step k sees step-0 keys causally plus, for each earlier step j ≥ 1, only the key at the same
index (the training-time-test structure of docs/eagle3.md §4.3, which is also what serving does).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.defaults import NORM_FLAGS, check_norm_flags


@dataclass(kw_only=True)
class TargetShape:
    """What a drafter (EAGLE-3's, DFlash's) takes from its target's config: widths, heads, vocabulary and RoPE."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # target vocabulary V
    target_hidden_size: int
    rope_theta: float
    max_position_embeddings: int
    # The target's RoPE scaling (its rope_type and parameters, e.g. Llama-3's "llama3"); None for plain RoPE. The
    # export writes it as rope_scaling, which the engines apply to the drafter, so training applies it too.
    rope_scaling: dict[str, Any] | None = None

    @staticmethod
    def of(target_config) -> dict[str, Any]:
        """These fields from a transformers config."""
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "target_hidden_size": c.hidden_size,
                "rope_theta": float(theta), "max_position_embeddings": c.max_position_embeddings,
                "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None}


@dataclass(kw_only=True)
class DrafterConfig(TargetShape):
    draft_vocab_size: int  # Vd
    num_aux: int
    # EAGLE 3.1's extra norms (docs/eagle3.md §1.2; vLLM and speculators read them, this SGLang does not), all off in
    # the EAGLE-3 baseline: one RMSNorm over cat(aux) before fc, or one per aux chunk; and the post-norm state, not
    # the pre-norm one, fed to the next step.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # P-EAGLE: the token id fed at every parallel slot (its embedding is the target's, frozen like the rest); None
    # for the EAGLE-3 chain.
    mask_token_id: int | None = None

    def __post_init__(self):
        check_norm_flags(self.norm_before_fc, self.fc_norm)

    @property
    def norms(self) -> dict[str, bool]:
        """The EAGLE 3.1 flags that are on, as the config.json keys the engines read."""
        return {k: True for k in NORM_FLAGS if getattr(self, k)}

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, num_aux: int, parallel: bool = False,
                    **norms: bool) -> DrafterConfig:
        """The drafter for a target (a transformers config): its widths, heads and RoPE; `num_aux` is the number
        of aux layers the features concatenate (the layout's); `parallel`, P-EAGLE (its mask token is the target
        vocabulary's last id); `norms`, EAGLE 3.1's flags."""
        vocab = target_config.vocab_size
        shape: dict[str, Any] = {**TargetShape.of(target_config), **norms}
        return cls(**shape, draft_vocab_size=min(draft_vocab_size, vocab), num_aux=num_aux,
                   mask_token_id=vocab - 1 if parallel else None)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, cfg: TargetShape):  # the target's shape is all it reads (DFlash shares it)
        super().__init__()
        hd, theta = cfg.head_dim, cfg.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))  # [hd/2]
        self.scale = 1.0  # YaRN's attention factor multiplies cos and sin
        if cfg.rope_scaling:  # the frequencies (and factor) transformers, vLLM and SGLang derive from the same fields
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rope_cfg = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                                   head_dim=hd, max_position_embeddings=cfg.max_position_embeddings,
                                   rope_parameters={"rope_theta": theta, **cfg.rope_scaling})
            inv_freq, self.scale = ROPE_INIT_FUNCTIONS[cfg.rope_scaling["rope_type"]](rope_cfg, None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x, position_ids):  # x [B, h, T, hd], position_ids [B, T]
        freqs = position_ids[:, None, :, None].float() * self.inv_freq  # [B, 1, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)
        return x * cos + rotate_half(x) * sin


class TTTCache:
    """Post-RoPE keys/values per step. Step 0 holds the context (causal); step j ≥ 1 holds one key per query
    index (the diagonal). In training every step covers all T indices; in decoding steps ≥ 1 cover the last.
    `past`: step-0 keys/values of context rows processed by an earlier draft (decoding continues from them, as a
    KV cache, and step 0 then runs on the new rows only)."""

    def __init__(self, past: tuple[torch.Tensor, torch.Tensor] | None = None, within: torch.Tensor | None = None):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.past = past
        # packed rows (training): [B, 1, T, T] bool, True where query t may see step-0 key u (u ≤ t, same sample),
        # so no sample attends to another; None: causal over the whole row. Keys of steps ≥ 1 sit at the query's
        # own index, inside its sample already.
        self.within = within


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size  # cat(embeds, hidden)
        self.q_proj = nn.Linear(width, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.rotary = Rotary(cfg)

    def forward(self, a, position_ids, cache: TTTCache):
        B, Tq, _ = a.shape
        q = self.q_proj(a).view(B, Tq, self.nh, self.hd).transpose(1, 2)  # [B, nh, Tq, hd]
        k = self.k_proj(a).view(B, Tq, self.nkv, self.hd).transpose(1, 2)  # [B, nkv, Tq, hd]
        v = self.v_proj(a).view(B, Tq, self.nkv, self.hd).transpose(1, 2)
        q, k = self.rotary(q, position_ids), self.rotary(k, position_ids)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, nh, Tq, hd]
        if not cache.keys and cache.past is not None:  # step 0 after earlier rows: prepend their keys
            k, v = torch.cat([cache.past[0], k], dim=2), torch.cat([cache.past[1], v], dim=2)  # [B, nh, P+Tq, hd]
        cache.keys.append(k)
        cache.values.append(v)
        if len(cache.keys) == 1:  # step 0: plain causal attention over the context
            past = k.shape[2] - Tq
            mask = None if past == 0 else torch.ones(Tq, k.shape[2], dtype=torch.bool, device=q.device).tril(past)
            mask = cache.within if cache.within is not None else mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        else:
            out = self._ttt_attention(q, cache)
        return self.o_proj(out.transpose(1, 2).reshape(B, Tq, self.nh * self.hd))

    def _ttt_attention(self, q, cache: TTTCache):
        k0, v0 = cache.keys[0], cache.values[0]  # [B, nh, T0, hd]
        Tq, T0 = q.shape[2], k0.shape[2]
        scale = 1.0 / math.sqrt(self.hd)
        s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, Tq, T0]
        q_idx = torch.arange(T0 - Tq, T0, device=q.device)  # queries are the last Tq step-0 indices
        causal = torch.arange(T0, device=q.device)[None, :] <= q_idx[:, None]  # [Tq, T0]
        s0 = s0.masked_fill(~(causal if cache.within is None else cache.within), float("-inf"))
        kd = torch.stack(cache.keys[1:], dim=-2)  # [B, nh, Tq, j, hd] — same-index keys of steps 1..j
        vd = torch.stack(cache.values[1:], dim=-2)
        sd = (q.unsqueeze(-2) * kd).sum(-1) * scale  # [B, nh, Tq, j]
        p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        return p[..., :T0] @ v0 + (p[..., T0:].unsqueeze(-1) * vd).sum(-2)


class MLP(nn.Module):
    def __init__(self, cfg: TargetShape):  # the target's shape is all it reads (DFlash shares it)
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # embeddings only
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # hidden stream only
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, position_ids, cache):
        residual = hidden  # norm_before_residual = false
        a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        h = residual + self.self_attn(a, position_ids, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    # buffers, declared so a type checker sees tensors (nn.Module's __getattr__ returns Tensor | Module)
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        # Always the target's input embedding, copied in by the trainer and by load_drafter, and frozen (SGLang
        # substitutes it anyway): allocated as zeros, since a random init would cost V·H draws for nothing.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.requires_grad_(False)
        width = cfg.num_aux * cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(width, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        if cfg.mask_token_id is not None:  # P-EAGLE's state at every parallel slot, in the space before fc
            self.mask_hidden = nn.Parameter(torch.zeros(width))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def project(self, aux):  # [B, T, n_aux·H_t] → [B, T, H]
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        if self.cfg.fc_norm:
            aux = torch.cat([norm(c) for norm, c in
                             zip(self.fc_norm, aux.chunk(self.cfg.num_aux, -1), strict=True)], -1)
        return self.fc(aux)

    def feed(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a draft step after the first takes, given the previous step's tokens [B, T] (the chain's draft or
        teacher-forced token) and output state [B, T, H]: those (EAGLE-3), or the mask token and fc(mask_hidden) at
        every index (P-EAGLE)."""
        if self.cfg.mask_token_id is None:
            return tokens, hidden
        mask = self.project(self.mask_hidden.to(hidden.dtype))  # [H]
        return torch.full_like(tokens, self.cfg.mask_token_id), mask.expand_as(hidden)

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             cache: TTTCache) -> torch.Tensor:
        """One draft step: returns the hidden state [B, T, H] fed back to the next step (pre-norm; post-norm under
        norm_output)."""
        h = self.midlayer(self.embed_tokens(input_ids), hidden, position_ids, cache)
        return self.norm(h) if self.cfg.norm_output else h

    def logits(self, hidden):  # [B, T, H], a step's output → [B, T, Vd]
        return self.lm_head(hidden if self.cfg.norm_output else self.norm(hidden))

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def set_vocab(self, used_ids: torch.Tensor) -> None:
        """Install d2t/t2d for an ascending list of the Vd target ids the draft vocabulary keeps (docs/eagle3.md §5)."""
        used = used_ids.to(torch.int64)
        assert used.numel() == self.cfg.draft_vocab_size, (used.numel(), self.cfg.draft_vocab_size)
        assert bool((used[1:] > used[:-1]).all()), "draft vocabulary ids must be ascending and distinct"
        self.d2t.copy_(used - torch.arange(used.numel()))
        self.t2d.zero_()
        self.t2d[used] = True

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything the checkpoint carries: all weights but the frozen embedding, plus d2t/t2d."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


# -------------------------------------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def chain_runs(drafter: Drafter, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor, prompt_len: int,
               k_max: int) -> list[int]:
    """a(s) for every round start s of the output ids[0, prompt_len:], from the target pass's aux and preds
    (services.evaluator.chains.target_pass): the chain of k_max drafts from each round start, all rows at once."""
    on = drafter.fc.weight.device
    ids, aux, preds = ids.to(on), aux.to(on, drafter.fc.weight.dtype), preds.to(on)
    rows = ids.shape[1] - 1
    pos = torch.arange(rows, device=on)[None]  # [1, T]
    cache = TTTCache()
    hidden = drafter.step(ids[:, 1:], drafter.project(aux[:, :rows]), pos, cache)  # [1, T, H]
    run = torch.zeros(rows, dtype=torch.long, device=on)  # accepted so far per row
    alive = torch.ones(rows, dtype=torch.bool, device=on)  # every draft so far accepted
    for j in range(k_max):
        if j:  # row t feeds preds[t+j]: the token draft j proposed, while every earlier draft was accepted
            hidden = drafter.step(*drafter.feed(preds[j: j + rows][None], hidden), pos + j, cache)
        draft = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))[0]  # [T]: row t's draft j+1
        alive &= draft == preds[1 + j: 1 + j + rows]
        run += alive.long()
    # round start s (context prompt + output[:s]) is the row ending at its last token: t = P + s - 2
    return run[prompt_len - 2: rows - 1].tolist()  # O entries


def chain_drafts(drafter: Drafter, h0: torch.Tensor, context: list[int], k: int,
                 past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor]]:
    """K greedy draft tokens (target ids) after `context`; h0 = fc(g) for rows 0..n-2 [1, n-1, H]. `past` holds
    the step-0 keys/values of the rows an earlier draft processed (every row stays valid: each pairs a context
    token with the target's own state), so only the new rows run; returns the drafts and the extended `past`."""
    n = len(context)
    done = 0 if past is None else past[0].shape[2]
    on = h0.device  # the drafter's, which is the target's input device
    ids = torch.tensor([context[1 + done:]], device=on)  # x_{t+1} beside g_t, for the rows not processed yet
    pos = torch.arange(done, n - 1, device=on)[None]
    cache = TTTCache(past)
    hidden = drafter.step(ids, h0[:, done:], pos, cache)[:, -1:]  # pre-norm state of the last row
    past = (cache.keys[0], cache.values[0])
    tok = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))  # [1, 1]
    out = [int(tok)]
    for j in range(1, k):
        hidden = drafter.step(*drafter.feed(tok, hidden), pos[:, -1:] + j, cache)
        tok = drafter.to_target_ids(drafter.logits(hidden).argmax(-1))
        out.append(int(tok))
    return out, past


def chain_step(drafter: Drafter, batch: int, context: int) -> Callable[[], None]:
    """One chain step after step 0 at `batch` sequences ([b, 1] token, [b, 1, H] state, [b, 1] position), attending
    to `context` step-0 keys, to the draft token id (chain_drafts's loop body, batched): a call that runs it, leaving
    the cache as it found it."""
    on, h = drafter.fc.weight.device, drafter.cfg.hidden_size
    cache = TTTCache()
    pos = torch.arange(context, device=on)[None].expand(batch, -1)  # [b, context]
    ids = torch.randint(drafter.cfg.vocab_size, (batch, context), device=on)
    state = torch.randn(batch, context, h, device=on, dtype=drafter.fc.weight.dtype)
    hidden = drafter.step(ids, state, pos, cache)
    tok, last, at = ids[:, -1:], hidden[:, -1:], pos[:, -1:] + 1

    def step() -> None:
        nxt = drafter.step(tok, last, at, cache)
        drafter.to_target_ids(drafter.logits(nxt).argmax(-1))
        del cache.keys[1:], cache.values[1:]  # the next call sees the same cache

    return step

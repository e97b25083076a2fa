"""Two changes to a transformers model's decoding that the in-process engine makes, where most of a batched decode
step's time went to copying the KV cache rather than to the model: growing the cache by concatenation and repeating
its grouped key/value heads for attention (the profile: bench/README.md § In-process decoding):

- `GrowingKVLayer`: the cache of a full-attention layer in a preallocated buffer that each step writes one slot of
  (a view of the filled part is what attention reads), instead of concatenating a new cache every step; a prefill
  run in parts writes its rows into it (`write_rows`).
- `grouped_sdpa`: attention through torch's SDPA with `enable_gqa`, which reads the grouped key/value heads in
  place; transformers repeats them into a copy whenever there is an attention mask (always, with left padding).

Both compute what the model computes without them, to float rounding (tests/test_decoding.py compares the logits
step by step; bench/decode.py the greedy answers, all the same). Used by the generator's in-process engine and the
evaluator's greedy reference.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

GROUPED_SDPA = "eyas_grouped_sdpa"


class GrowingKVLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer of `capacity` positions (doubled if a step outgrows it);
    `keys` / `values` are views of the filled part: [batch, kv_heads, filled, head_dim]."""

    # set by lazy_initialization, before anything reads them (DynamicLayer types them as optional)
    keys: torch.Tensor
    values: torch.Tensor
    _k: torch.Tensor | None  # the buffers: None until the first update allocates them
    _v: torch.Tensor | None

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]

    @property
    def filled(self) -> int:
        return self.keys.shape[-2]

    def _grow(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        cap = max(self.capacity, need, 2 * self.filled)
        new_k = self.keys.new_empty(*self.keys.shape[:2], cap, self.keys.shape[-1])
        new_v = self.values.new_empty(*self.values.shape[:2], cap, self.values.shape[-1])
        new_k[:, :, :self.filled] = self.keys
        new_v[:, :, :self.filled] = self.values
        self._k, self._v, self.capacity = new_k, new_v, cap
        return new_k, new_v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.filled + key_states.shape[-2]
        k, v = self._k, self._v
        if k is None or v is None or end > k.shape[-2]:
            k, v = self._grow(end)
        k[:, :, self.filled:end] = key_states
        v[:, :, self.filled:end] = value_states
        self.keys, self.values = k[:, :, :end], v[:, :, :end]
        return self.keys, self.values

    def write_rows(self, rows: torch.Tensor, batch: int, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Prefill in parts: keys/values [len(rows), kv_heads, w, head_dim] of batch rows `rows` into slots
        end - w .. end (left padding: the slots before stay zero, and the attention mask hides them)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
            self.capacity = max(self.capacity, end)
            self._k = keys.new_zeros(batch, keys.shape[1], self.capacity, keys.shape[-1])
            self._v = values.new_zeros(batch, values.shape[1], self.capacity, values.shape[-1])
        k, v = self._k, self._v
        assert k is not None and v is not None, "a layer prefilled in parts is written by write_rows from the start"
        k[rows, :, end - keys.shape[-2]:end] = keys
        v[rows, :, end - values.shape[-2]:end] = values
        self.keys, self.values = k[:, :, :end], v[:, :, :end]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (rows that ended leave): copies the filled part once."""
        if self.is_initialized and self._k is not None and self._v is not None:
            filled = self.filled
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :filled], self._v[:, :, :filled]


def growing_cache(config, capacity: int) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers preallocate `capacity` positions (sliding-window and
    other layer kinds keep transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingKVLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but grouped key/value heads are read in place (`enable_gqa`) under a mask."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or kwargs.get("s_aux") is not None or query.shape[-1] != value.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling,
                                         enable_gqa=True)  # [B, heads, q, D]
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def grouped_sdpa(model):
    """Within the block, a model that attends with SDPA reads grouped key/value heads in place; other attention
    kinds stay as they are."""
    before = model.config._attn_implementation
    if before != "sdpa":
        yield
        return
    if GROUPED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
        AttentionMaskInterface.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(GROUPED_SDPA)
    try:
        yield
    finally:
        model.set_attn_implementation(before)

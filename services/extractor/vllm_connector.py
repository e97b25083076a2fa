"""Eyas's hidden-states KV connector for vLLM (≥ 0.32), loaded by the capture engine (services.extractor.vllm_server)
with `kv_transfer_config={"kv_connector": "EyasCaptureConnector", "kv_connector_module_path": __name__, ...}` beside
`speculative_config={"method": "extract_hidden_states", ...}`. Runs inside the vLLM process; imports vLLM.

vLLM's extract_hidden_states method writes the target's states at the requested layer ids into the KV cache of a
cache-only layer, [num_blocks, n_ids, block_size, hidden], at each scheduled token's slot. Scheduler side: this
connector tracks each request's block table (of the KV-cache group that holds the cache-only layer) and sends the
worker, per step, the slots of the prompt positions computed in that step (prefills come in chunks). Worker side:
after each step's forwards (wait_for_save) it copies those rows into the request's [T, n_ids, hidden] buffer, and
once the last prompt position is in, keeps the buffer under the request's capture key until `take` collects it.
It neither pins memory nor records CUDA events (the shipped example connector does both, which fails on the CPU
backend), holds no block back, and writes no file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

CACHE_ONLY = "cache_only_layers"  # in the name of the layer vLLM's extract_hidden_states writes into
CAPTURED: dict[str, torch.Tensor] = {}  # worker side: capture key → [T, n_ids, hidden], until taken


@torch.inference_mode()
def take(worker: Any, keys: list[str], final_col: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(LLM.collective_rpc, on every worker) key → (states [T, n_ids, hidden], the model's final norm applied to
    their column `final_col` [T, hidden]) for `keys`, popped; tensor-parallel rank 0's (every rank holds the same
    residual stream; the others return nothing)."""
    got = {k: CAPTURED.pop(k) for k in keys if k in CAPTURED}
    if get_tensor_model_parallel_rank() != 0:
        return {}
    norm = worker.get_model().model.norm  # the norm the engine applies before its lm_head
    device = next(norm.parameters()).device
    return {k: (hs, norm(hs[:, final_col].to(device)).cpu()) for k, hs in got.items()}


def capture_key(sampling_params: Any, req_id: str) -> str:
    extra = (sampling_params.extra_args or {}) if sampling_params is not None else {}
    return str((extra.get("kv_transfer_params") or {}).get("capture_key", req_id))


@dataclass
class _Segment:
    req_id: str
    key: str
    start: int  # first prompt position computed in this step
    slots: list[int]  # cache slots of positions start … start + len(slots) - 1
    prompt_len: int


@dataclass
class _Metadata(KVConnectorMetadata):
    segments: list[_Segment] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # requests finished or aborted since the previous step


@dataclass
class _Tracked:  # scheduler side: a request whose prompt is not fully computed yet
    key: str
    prompt_len: int
    blocks: list[int]
    first: bool = True


class EyasCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._group, self._block_size = 0, vllm_config.cache_config.block_size
        if kv_cache_config is not None:  # the group holding the cache-only layer, and its block size
            groups = [i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                      if any(CACHE_ONLY in n for n in g.layer_names)]
            if len(groups) != 1:
                raise ValueError(f"expected one KV-cache group with the cache-only layer, found {len(groups)}")
            self._group = groups[0]
            self._block_size = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        self._tracked: dict[str, _Tracked] = {}
        self._cache: torch.Tensor | None = None  # worker side: [num_blocks, n_ids, block_size, hidden]
        self._buffers: dict[str, torch.Tensor] = {}  # worker side: req_id → [T, n_ids, hidden]

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False  # nothing is loaded from outside

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        del request, blocks, num_external_tokens  # nothing is loaded from outside

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = _Metadata(finished=set(scheduler_output.finished_req_ids))
        for rid in meta.finished:
            self._tracked.pop(rid, None)
        starts: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            if r.prompt_token_ids is None:
                continue
            self._tracked[r.req_id] = _Tracked(capture_key(r.sampling_params, r.req_id), len(r.prompt_token_ids),
                                               list(r.block_ids[self._group]))
            starts[r.req_id] = r.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted, then resumed: a new block table, the prefill again
                t.blocks, t.first = list(new[self._group]) if new else [], True
            elif new:
                t.blocks += new[self._group]
            starts[rid] = cached.num_computed_tokens[i]
        for rid, start in starts.items():
            t = self._tracked[rid]
            end = min(start + scheduler_output.num_scheduled_tokens.get(rid, 0), t.prompt_len)
            if t.first:  # positions before `start` were prefix-cache hits: their rows are in the cached blocks
                start, t.first = 0, False
            if end > start:
                bs = self._block_size
                slots = [t.blocks[p // bs] * bs + p % bs for p in range(start, end)]
                meta.segments.append(_Segment(rid, t.key, start, slots, t.prompt_len))
            if end >= t.prompt_len:
                del self._tracked[rid]
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, {"capture_key": capture_key(request.sampling_params, request.request_id)}

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        return self.request_finished(request, [])

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = [n for n in kv_caches if CACHE_ONLY in n]
        if len(names) != 1:
            raise ValueError(f"expected one cache-only layer, found {names}")
        self._cache = kv_caches[names[0]]
        if self._cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-state cache {tuple(self._cache.shape)} against block size {self._block_size}")

    def start_load_kv(self, forward_context, **kwargs):
        del forward_context, kwargs  # nothing to load

    def wait_for_layer_load(self, layer_name):
        del layer_name

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        del layer_name, kv_layer, attn_metadata, kwargs  # the rows are read in wait_for_save, once the step's
        # forwards (which write them) have run

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for rid in meta.finished:
            self._buffers.pop(rid, None)
        cache, bs = self._cache, self._block_size
        for s in meta.segments:
            buf = self._buffers.get(s.req_id)
            if buf is None:
                buf = self._buffers[s.req_id] = torch.empty((s.prompt_len, cache.shape[1], cache.shape[3]),
                                                            dtype=cache.dtype)
            slots = torch.tensor(s.slots, dtype=torch.long, device=cache.device)
            buf[s.start: s.start + len(s.slots)] = cache[slots // bs, :, slots % bs].cpu()
            if s.start + len(s.slots) == s.prompt_len:  # the last prefill chunk: the request is complete
                CAPTURED[s.key] = self._buffers.pop(s.req_id)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None

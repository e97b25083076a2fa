"""P-EAGLE: the EAGLE-3 drafter fed a learned mask state after its first step (eyas.drafter, DrafterConfig's
mask_token_id), so vLLM drafts all K tokens in one forward ("parallel_drafting": true). Its exports are EAGLE-3's
with a top-level mask_token_id and mask_hidden; SGLang's EAGLE-3 worker drafts a chain, so it cannot serve one."""
from __future__ import annotations

from typing import Any

from eyas.methods.eagle3 import Eagle3


class PEagle(Eagle3):
    name = "peagle"
    title = "P-EAGLE"
    summary = ("P-EAGLE, the same drafter fed a learned mask state after its first step, so vLLM drafts all "
               "ttt_steps tokens in one forward (served with \"parallel_drafting\": true)")
    parallel = True
    speculators_type, speculators_architecture = "peagle", "PEagleSpeculator"
    refused_engines = {"sglang": "its EAGLE-3 worker drafts a chain and reads no mask_hidden: a P-EAGLE drafter "
                                 "would see the drafts it was not trained on (vLLM serves it with parallel_drafting)"}

    def reads(self, config: dict[str, Any]) -> bool:
        return config.get("mask_token_id") is not None  # an EAGLE-3 config with the mask token at the top level

    def owns(self, net: Any) -> bool:
        from eyas.drafter import Drafter

        return isinstance(net, Drafter) and net.cfg.mask_token_id is not None

    def speculative_config(self, model: str, k: int) -> dict[str, Any]:
        return {**super().speculative_config(model, k), "parallel_drafting": True}

"""What every drafting method is: the facts the stages read instead of comparing method names, and the work that
differs from method to method (building the drafter, its objective, its exports and their loading, replay and
in-process drafting, the `--speculative-config` vLLM serves it with).

No torch at import (the CLI builds its flags from the specs, which read these facts): a method imports its
network's modules inside the methods that need them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from eyas.batching import Batch
    from eyas.layout import Layout
    from eyas.ttt import TTTResult


class DraftingMethod(ABC):
    """One drafting method. A subclass states its facts (the class attributes) and does its own work (the abstract
    methods: a method that leaves one out cannot be registered); register it in eyas.methods.METHODS."""

    name: ClassVar[str]  # the spec's and the manifest's `method`
    title: ClassVar[str]  # as the docs and messages name it
    summary: ClassVar[str]  # one line for the spec's and the CLI's help
    export_dirs: ClassVar[tuple[str, ...]]  # the exports the trainer writes for it (directories of the artifact)
    served_dir: ClassVar[str]  # the export vLLM is given, and the evaluator loads
    # (engine, export dir) for every engine that loads one of its exports
    served_by: ClassVar[tuple[tuple[str, str], ...]]
    parallel: ClassVar[bool]  # drafts all K tokens in one forward (else a chain, one forward per token)
    fixed_block: ClassVar[bool]  # drafts a fixed block (K = its training's ttt_steps, whatever K is asked)
    packs: ClassVar[bool]  # its objective keeps each sample of a packed row to itself (eyas.batching.collate_rows)
    draft_vocab: ClassVar[bool]  # proposes from a draft vocabulary of Vd ids (else the target's whole vocabulary)
    takes_norms: ClassVar[bool]  # EAGLE 3.1's norm flags apply to it
    several_layers: ClassVar[bool]  # draft_layers may exceed 1
    layers: ClassVar[int] = 1  # its decoder layers unless the spec's draft_layers says
    refused_engines: ClassVar[dict[str, str]] = {}  # engine → why it cannot serve any drafter of this method

    def __repr__(self) -> str:
        return f"<drafting method {self.name}>"

    # ------------------------------------------------------------------------------------------------- recognition

    def reads(self, config: dict[str, Any]) -> bool:
        """Whether an export's config.json is one of this method's (the default method reads what no other
        claims)."""
        return False

    def owns(self, net: Any) -> bool:
        """Whether a drafter network is one of this method's (the default method owns what no other claims)."""
        return False

    # ---------------------------------------------------------------------------------------------------- serving

    @abstractmethod
    def speculative_config(self, model: str, k: int) -> dict[str, Any]:
        """The `--speculative-config` vLLM serves it with (model: where the server reads the served export)."""

    # --------------------------------------------------------------------------------------------------- training

    @abstractmethod
    def build(self, spec: Any, target: str, layout: Layout, embed: torch.Tensor, head: torch.Tensor,
              used: torch.Tensor | None) -> Any:
        """A fresh drafter for the train spec `spec` (services.trainer.spec.Spec): the target's embedding `embed`
        and lm_head `head`; `used`, the draft vocabulary's ids (when `draft_vocab`)."""

    @abstractmethod
    def objective(self, drafter: Any, batch: Batch, target_lm_head: torch.Tensor, steps: int, decay: float,
                  recompute: bool, generator: torch.Generator | None) -> TTTResult:
        """Its loss terms and per-position accuracy counts on a batch (eyas.objective.objective)."""

    @abstractmethod
    def export(self, spec: Any, target: str, layout: Layout, weights: dict[str, torch.Tensor], head: torch.Tensor,
               out: Path, verifier: dict[str, Any]) -> tuple[list[Path], dict[str, str]]:
        """Write its exports of the trained `weights` (the target's embedding included) under `out`; returns the
        files written (relative to `out`) and the engines that cannot serve them, with why."""

    @abstractmethod
    def load(self, path: Path, config: dict[str, Any], embed_weight: torch.Tensor, dtype: torch.dtype,
             overrides: dict[str, Any] | None, missing_vocab_map: bool, lm_head_weight: torch.Tensor | None) -> Any:
        """One of its exports (config.json `config`) → its drafter, eval mode (eyas.exports.load_drafter)."""

    # ------------------------------------------------------------------------------------------------- evaluation

    def drafted_ks(self, drafter: Any, k_max: int) -> list[int]:
        """The K a replay of its runs measures: every K ≤ k_max (draft i does not depend on K)."""
        return list(range(1, k_max + 1))

    @abstractmethod
    def replay_runs(self, drafter: Any, ids: torch.Tensor, aux: torch.Tensor, preds: torch.Tensor,
                    prompt_len: int, k_max: int) -> list[int]:
        """a(s), the drafts accepted from every round start s of the output ids[0, prompt_len:], from the target
        pass's aux states and greedy preds (services.evaluator.chains.target_pass)."""

    @abstractmethod
    def draft_step(self, drafter: Any, batch: int, context: int) -> tuple[int, Callable[[], None]]:
        """One draft step at `batch` sequences after `context` tokens, ready to time (services.evaluator.steptime):
        the tokens it drafts and a call that runs it, the same each time."""

    @abstractmethod
    def context_states(self, drafter: Any, aux: torch.Tensor) -> torch.Tensor:
        """What in-process decoding keeps of the target's aux states [1, n, n_aux·H_t], per row."""

    @abstractmethod
    def propose(self, drafter: Any, states: torch.Tensor, context: list[int], k: int,
                past: Any) -> tuple[list[int], Any]:
        """K greedy drafts after `context` in in-process decoding (services.evaluator.specdec), from the kept
        states of rows 0..n-2; `past`, what an earlier call kept (None at first). Returns the drafts and the new
        `past`."""

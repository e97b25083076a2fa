"""Warm start (`init_from`): a train job that starts from a trained drafter's weights instead of a fresh
initialisation, with a fresh optimizer and learning-rate schedule. The drafter is loaded through THE loader
(eyas.methods.load_drafter) from the export its method serves, after checking that it reads the features' layout,
is of the job's method and drafts from the job's draft vocabulary size; anything else is refused (WarmStartMismatch)
before a step is taken."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from eyas.layout import Layout, LayoutMismatch, check_layout
from eyas.manifest import fetch_verified, read_manifest
from eyas.methods import get_method, load_drafter, method_of
from eyas.settings import Settings
from eyas.store import open_artifact
from services.trainer.spec import Spec


class WarmStartMismatch(LayoutMismatch):
    """`init_from` names a drafter that cannot start this job: another layout, method or draft vocabulary."""


def check_init(spec: Spec, layout: Layout, manifest: Any) -> None:
    """Refuse a drafter artifact's manifest that does not fit the job (its features' `layout`)."""
    where = f"init_from={spec.init_from}"
    if manifest.drafter is None or not manifest.layout:
        raise WarmStartMismatch(f"{where}: its manifest lacks the layout or the training facts")
    check_layout(layout, Layout.from_dict(manifest.layout), what=f"{where}: the drafter's (the features' expected)")
    method, theirs = get_method(spec.method), method_of(manifest)
    if theirs is not method:
        raise WarmStartMismatch(f"{where}: a {theirs.title} drafter cannot warm-start a {method.title} job "
                                f"(method={spec.method})")
    if method.draft_vocab and manifest.drafter.draft_vocab_size != spec.draft_vocab_size:
        raise WarmStartMismatch(f"{where}: its draft vocabulary has {manifest.drafter.draft_vocab_size} ids, the job "
                                f"asks draft_vocab_size={spec.draft_vocab_size}")


def warm_start(spec: Spec, layout: Layout, drafter: torch.nn.Module, embed: torch.Tensor, head: torch.Tensor,
               settings: Settings) -> None:
    """Copy the `init_from` drafter's weights (its draft vocabulary mapping included) into the freshly built
    `drafter`, in place."""
    art = open_artifact(spec.init_from, settings)
    manifest = read_manifest(art, kind="drafter")
    check_init(spec, layout, manifest)
    served = method_of(manifest).served_dir
    with tempfile.TemporaryDirectory(prefix="eyas-init-") as tmp:
        for name in manifest.files:
            if name.startswith(f"{served}/"):
                (Path(tmp) / name).parent.mkdir(parents=True, exist_ok=True)
                fetch_verified(art, manifest, name, Path(tmp) / name)
        loaded, _ = load_drafter(Path(tmp) / served, embed, lm_head_weight=head)
    try:
        drafter.load_state_dict(loaded.state_dict(), strict=True)
    except RuntimeError as e:  # another architecture (norm flags, layers): the spec must match the drafter's
        raise WarmStartMismatch(f"init_from={spec.init_from}: its architecture differs from the job's: "
                                f"{str(e).splitlines()[0]} (give the drafter's own norm flags and draft_layers)") from e

"""The drafting methods (EAGLE-3, P-EAGLE, DFlash), each a type that owns what differs between them
(eyas.methods.base.DraftingMethod). A method is read once, from the train spec's or the drafter manifest's
`method` (get_method, method_of), an export's config.json (method_of_export) or a drafter network
(method_of_drafter); every other module asks the method, never its name.

Adding a method: one module here with its DraftingMethod subclass, and its line in METHODS.

No torch at import: the spec modules read the methods' facts to build the CLI's flags.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.methods.base import DraftingMethod
from eyas.methods.dflash import DFlash
from eyas.methods.eagle3 import Eagle3
from eyas.methods.peagle import PEagle

if TYPE_CHECKING:
    import torch

METHODS: dict[str, DraftingMethod] = {m.name: m for m in (Eagle3(), PEagle(), DFlash())}
DEFAULT_METHOD = Eagle3.name  # a spec or manifest that names none
EXPORT_DIRS = tuple(dict.fromkeys(d for m in METHODS.values() for d in m.export_dirs))
# (engine, export dir) for every export an engine loads, of any method
SERVED = tuple(dict.fromkeys(s for m in METHODS.values() for s in m.served_by))


def get_method(name: str | None) -> DraftingMethod:
    """The method a spec, manifest or report names (DEFAULT_METHOD when none)."""
    try:
        return METHODS[name or DEFAULT_METHOD]
    except KeyError:
        raise ValueError(f"unknown drafting method {name!r} (one of {', '.join(METHODS)})") from None


def method_of(manifest: Any) -> DraftingMethod:
    """The method of a drafter artifact's manifest (eyas.manifest.Manifest): its training facts' (DEFAULT_METHOD
    for a manifest without them)."""
    return get_method(manifest.drafter.method if manifest.drafter is not None else None)


def method_of_export(config: dict[str, Any]) -> DraftingMethod:
    """The method an export's config.json was trained for (the default one reads what no other claims)."""
    return next((m for m in METHODS.values() if m.reads(config)), METHODS[DEFAULT_METHOD])


def method_of_drafter(net: Any) -> DraftingMethod:
    """The method of a drafter network (the default one owns what no other claims)."""
    return next((m for m in METHODS.values() if m.owns(net)), METHODS[DEFAULT_METHOD])


def load_drafter(path: Path, embed_weight: torch.Tensor, dtype: torch.dtype | None = None,
                 overrides: dict[str, Any] | None = None, missing_vocab_map: bool = False,
                 lm_head_weight: torch.Tensor | None = None) -> tuple[Any, dict]:
    """THE checkpoint loader: an export directory (config.json + model.safetensors: the EAGLE layout or speculators
    format, or another method's own) → (the drafter of the method its config names (method_of_export), in eval
    mode, in `dtype` (default float32), on the device of `embed_weight`; its config.json).

    `embed_weight` is the target's input embedding [V, H]; the drafter always uses it (docs/eagle3.md §2.1).
    `overrides` replace config fields (e.g. a norm flag the weights show but the config lacks); with
    `missing_vocab_map`, a checkpoint without d2t/t2d loads with the identity mapping an engine falls back to (the
    diagnosis of such a drafter), where it is otherwise refused. A method that drafts with the target's lm_head
    (DFlash) needs `lm_head_weight` [V, H].
    """
    import torch

    from eyas.exports import CONFIG

    cfg_json = json.loads((Path(path) / CONFIG).read_text())
    drafter = method_of_export(cfg_json).load(path, cfg_json, embed_weight, dtype or torch.float32, overrides,
                                              missing_vocab_map, lm_head_weight)
    return drafter, cfg_json

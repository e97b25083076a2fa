"""The drafting methods (EAGLE-3, P-EAGLE, DFlash), each a type that owns what differs between them
(eyas.methods.base.DraftingMethod). A method is read once, from the train spec's or the drafter manifest's
`method` (get_method, method_of), an export's config.json (method_of_export) or a drafter network
(method_of_drafter); every other module asks the method, never its name.

Adding a method: one module here with its DraftingMethod subclass, and its line in METHODS.

No torch at import: the spec modules read the methods' facts to build the CLI's flags.
"""
from __future__ import annotations

from typing import Any

from eyas.methods.base import DraftingMethod
from eyas.methods.dflash import DFlash
from eyas.methods.eagle3 import Eagle3
from eyas.methods.peagle import PEagle

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

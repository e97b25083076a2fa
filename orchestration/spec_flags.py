"""A pydantic spec as command-line flags and back: one flag per scalar field (nested models as `parent.field`
destinations), its help the field's description. The stage commands and `eyas proxy` build their flags here."""
from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(annotation) -> tuple[Any, list | None]:
    """(argparse type, choices) for a field annotation; (None, None) when it is not a plain scalar."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a field that names a file or URL (eyas.confine.names): a string
        return _scalar_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0]) if len(args) == 1 else (None, None)
    if origin is typing.Literal:
        choices = list(typing.get_args(annotation))
        return type(choices[0]), choices
    if annotation in (str, int, float):
        return annotation, None
    if annotation is bool:
        return bool, None
    if origin in (list, dict):
        return json.loads, None
    return None, None


def add_spec_arguments(parser: argparse.ArgumentParser, spec_cls: type[BaseModel], prefix: str = "") -> None:
    for name, field in spec_cls.model_fields.items():
        if name == "then":
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            add_spec_arguments(parser, ann, prefix=f"{prefix}{name}.")
            continue
        typ, choices = _scalar_type(ann)
        if typ is None:
            continue
        default = None if field.is_required() else field.default
        said = field.is_required() or "(default:" in (field.description or "")  # the description says it better
        help_text = (field.description or "") + ("" if said else f" (default: {default})")
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        dest = f"{prefix}{name}"
        if typ is bool:
            parser.add_argument(_flag(name), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(_flag(name), dest=dest, type=typ, choices=choices, default=None,
                                required=field.is_required() and not prefix, help=help_text,
                                metavar=None if choices else name.upper())


def spec_from_args(args: argparse.Namespace, skip: set[str]) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if value is None or dest in skip:
            continue
        *parents, leaf = dest.split(".")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


def add_settings_command(sub, name: str, help_text: str, description: str | None, settings: type[BaseModel],
                         workdir: str) -> argparse.ArgumentParser:
    """A command whose flags are a settings model's fields, plus the embedded store's --workdir (what goes there:
    `workdir`) and -v (`eyas proxy`, `eyas watch`)."""
    p = sub.add_parser(name, help=help_text, description=description)
    add_spec_arguments(p, settings)
    p.add_argument("--workdir", type=Path, help=f"embedded store {workdir} (default: ./eyas-work)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages too")
    return p

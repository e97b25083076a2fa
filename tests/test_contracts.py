"""The code layout's promises that lint cannot see: the contract library imports on a box without the service
stack, and every command's --help prints."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eyas
from orchestration.cli import build_parser, main
from orchestration.registry import STAGES, get_stage, stage_spec

SERVICE_STACK = ("fastapi", "starlette", "uvicorn", "celery", "kombu", "redis", "httpx", "prometheus_client",
                 "minio", "tenacity")


def test_eyas_imports_without_the_service_stack():
    """Every eyas module imports when the web, queue and HTTP-client libraries are missing (a GPU box)."""
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, pkgutil, sys
        BLOCKED = {SERVICE_STACK!r}

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")

        sys.meta_path.insert(0, Missing())
        import eyas
        names = [m.name for m in pkgutil.iter_modules(eyas.__path__, "eyas.")]
        for name in names:
            importlib.import_module(name)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        print(len(names))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    root = Path(eyas.__file__).parent
    modules = [f for f in root.glob("*.py") if f.name != "__init__.py"] + list(root.glob("*/__init__.py"))
    assert int(out.stdout.strip()) == len(modules) > 10  # every module and subpackage of the library was imported


def commands() -> list[list[str]]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return [[]] + [[name] for name in sub.choices]


@pytest.mark.parametrize("command", commands(), ids=lambda c: " ".join(c) or "eyas")
def test_every_help_prints(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: eyas") and len(text.splitlines()) > 3


def test_help_imports_no_stage():
    """`eyas --help` and every command's --help build the flags from the specs alone: no stage (a spec module only),
    torch, transformers, numpy or service library is imported until a command runs (they take seconds to import)."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from orchestration.cli import main
        for command in {commands()!r}:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main([*command, "--help"])
                except SystemExit as e:
                    assert e.code == 0, (command, e.code)
            assert "--" in out.getvalue(), command
        heavy = {("torch", "transformers", "numpy", *SERVICE_STACK)!r}
        stage_modules = [m for m in sys.modules if m.startswith("services.") and m.count(".") == 2]
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy))
        print(sorted(m for m in stage_modules if not m.endswith("spec")))
        print(len(stage_modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    heavy, stages, specs = out.stdout.split("\n")[:3]
    assert (heavy, stages) == ("[]", "[]")
    assert int(specs) >= len(STAGES)  # the parser did read every stage's spec


def _options(parser, path: str):
    """(command, option, help) for every option of the parser and of its subcommands."""
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):  # the subcommands
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings and action.dest != "help":
            yield path, action.option_strings[-1], action.help


def test_every_option_says_what_it_does():
    """Every flag of every command has help beyond its default (a spec field without a description would show
    only "(default: …)")."""
    options = list(_options(build_parser(), "eyas"))
    assert len(options) > 100 and {o for _, o, _ in options} >= {"--shard-mb", "--cache-gb", "--concurrency"}
    bare = [f"{command} {option}" for command, option, text in options
            if not re.sub(r"\(default: [^)]*\)$", "", (text or "").strip()).strip()]
    assert not bare, f"options without help: {bare}"


def test_the_cli_reads_each_stage_spec():
    """The spec module the CLI builds a command from holds the very spec the stage runs with."""
    assert all(stage_spec(name) is get_stage(name).spec_cls for name in STAGES)

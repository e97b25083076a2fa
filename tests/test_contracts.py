"""The code layout's promises that lint cannot see: the contract library imports on a box without the service
stack, and every command's --help prints."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import eyas
from orchestration.cli import build_parser, main

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
    modules = [f for f in Path(eyas.__file__).parent.glob("*.py") if f.name != "__init__.py"]
    assert int(out.stdout.strip()) == len(modules) > 10  # every module of the library was imported


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

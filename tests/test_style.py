"""House style the linters do not check: no function in the service code is longer than a screen (issue #43: a
function that fits on a screen can be read whole; longer ones had grown phases, hand-written offsets and nested
functions returning tuples). Pure AST: fast, and it imports nothing it checks."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eyas", "services", "orchestration")
MAX_LINES = 60  # a screen
# "path:function" kept longer, each with its reason; a function over MAX_LINES not here fails the test
ALLOWED: dict[str, str] = {}


def _long_functions() -> dict[str, int]:
    """Every function (methods and nested ones included) over MAX_LINES, as "path:name" → lines (its decorators,
    signature and docstring counted)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    lines = node.end_lineno - first + 1
                    if lines > MAX_LINES:
                        found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_is_longer_than_a_screen():
    long = {name: n for name, n in _long_functions().items() if name not in ALLOWED}
    assert not long, f"functions over {MAX_LINES} lines (split them into named parts, or list one in ALLOWED " \
                     f"with its reason): {long}"


def test_the_allow_list_names_only_functions_still_too_long():
    assert set(ALLOWED) <= set(_long_functions()), "a function in ALLOWED is short now: take it off the list"


def test_no_module_defines_a_function_or_class_twice():
    # ruff's F811 misses a redefinition whose first definition is called from a function body: the call then runs
    # the later one (a refactor named a new helper like an existing one, and the existing one's caller ran it)
    twice = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            names = [n.name for n in ast.parse(path.read_text()).body
                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
            twice += [f"{path.relative_to(ROOT).as_posix()}:{n}" for n in sorted(set(names)) if names.count(n) > 1]
    assert not twice, twice


def _import_cycles() -> list[list[str]]:
    """Every import cycle among the service code's modules at run time (imports inside functions count; those under
    `if TYPE_CHECKING:` do not), each as the chain of modules that closes it."""
    import grimp

    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    cycles, seen = [], set()
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back and frozenset(back) not in seen:
                seen.add(frozenset(back))
                cycles.append([module, *back])
    return cycles


def test_no_import_cycle():
    """Modules import each other in one direction (issue #43: the methods registry, the exports and the manifest
    imported each other, and a module in such a circle cannot be read, or imported first, on its own)."""
    assert not _import_cycles(), f"import cycles (move what both sides need below them): {_import_cycles()}"

"""The drafting methods are a type (eyas.methods): the registry imports no torch, every method states its facts
and does its own work, an export's config and a drafter network name their method, and no module outside the
methods' own tells the methods apart by name or network type."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from eyas.methods import DEFAULT_METHOD, METHODS, DraftingMethod, get_method, method_of_export

ROOT = Path(__file__).resolve().parent.parent
FACTS = ("name", "title", "summary", "export_dirs", "served_dir", "served_by", "parallel", "fixed_block",
         "draft_vocab", "takes_norms", "several_layers", "layers", "refused_engines")


def test_the_registry_imports_no_torch():
    """The spec modules read the methods' facts to build the CLI's flags: no torch at import."""
    code = "import sys, eyas.methods; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_states_its_facts(name):
    method = get_method(name)
    assert isinstance(method, DraftingMethod) and method.name == name
    assert all(hasattr(method, fact) for fact in FACTS)
    assert method.served_dir in method.export_dirs
    assert {d for _, d in method.served_by} <= set(method.export_dirs)
    assert method.speculative_config("DIR", 3)["model"] == "DIR"


def test_a_method_that_leaves_out_its_work_cannot_be_made():
    class Half(DraftingMethod):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_an_unknown_method_is_refused_by_name():
    assert get_method(None) is METHODS[DEFAULT_METHOD]
    with pytest.raises(ValueError, match="unknown drafting method 'medusa'"):
        get_method("medusa")


def test_an_export_config_names_its_method():
    assert method_of_export({"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 1}}).name \
        == "dflash"
    assert method_of_export({"architectures": ["LlamaForCausalLMEagle3"], "mask_token_id": 7}).name == "peagle"
    assert method_of_export({"architectures": ["LlamaForCausalLMEagle3"]}).name == "eagle3"
    assert method_of_export({"speculators_model_type": "eagle3"}).name == DEFAULT_METHOD


def _method_compares(path: Path) -> list[str]:
    """Where a module names a method (a string constant that is a method's name) or tests a drafter's network
    type (isinstance with a drafter class)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in METHODS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and \
                "Drafter" in ast.unparse(node.args[1]):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_methods_tells_them_apart():
    """The method is read once (the spec, the manifest, an export's config, a network: eyas.methods); every other
    module asks it for its facts and its work."""
    methods = ROOT / "eyas" / "methods"
    found = [hit for package in ("eyas", "services", "orchestration")
             for path in sorted((ROOT / package).rglob("*.py")) if methods not in path.parents
             for hit in _method_compares(path)]
    assert found == []

"""Wiring check: what vLLM and SGLang would concatenate for a drafter's export configs, refused when it is not what
the drafter was trained on. Fast (no vLLM); the exports are real checkpoints of a small drafter."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from eyas.drafter import Drafter
from eyas.exports import export_drafter
from eyas.layout import EMBED, Layout
from eyas.methods import get_method
from eyas.methods.eagle3 import drafter_config
from eyas.target import BUNDLED, load_target
from services.evaluator.wiring import WiringMismatch, check_wiring
from services.extractor.core import layout_for


@pytest.fixture(scope="module")
def target():
    return load_target(BUNDLED)


def export(target, dest: Path) -> Path:
    """A small drafter for the bundled target (default layout), exported by the trainer: eagle/ + speculators/."""
    drafter = Drafter(drafter_config(BUNDLED, 64, layout_for(target, None)))
    drafter.set_vocab(torch.arange(64))
    export_drafter(drafter.cfg, drafter.state_dict(), layout_for(target, None), dest, "float32",
                   {"name_or_path": str(target.path), "architectures": ["LlamaForCausalLM"]}, 3, get_method("eagle3"))
    return dest


def edit_config(path: Path, **changes) -> None:
    """What a hand-edited or foreign-tool config does: change fields (None removes one)."""
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def as_layout(d: Path, layout: Layout) -> None:
    """Re-label an export as trained on `layout`, with the aux ids each engine needs for it (docs/eagle3.md §3.4)."""
    edit_config(d / "eagle" / "config.json", eyas_layout=layout.to_dict(),
                eagle_aux_hidden_state_layer_ids=layout.vllm_ids,
                eagle_config={"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": layout.sglang_ids})
    edit_config(d / "speculators" / "config.json", eyas_layout=layout.to_dict(),
                eagle_aux_hidden_state_layer_ids=layout.vllm_ids)


def test_default_layout_is_served_as_trained_by_both_engines(target, tmp_path):
    layout = layout_for(target, None)
    got = check_wiring(layout, export(target, tmp_path), target)
    want = ["out(1)", "out(14)", "out(26)"]
    assert got["trained"] == want
    assert got["served"] == {"vllm:eagle": want, "vllm:speculators": want, "sglang:eagle": want}


def test_trained_with_embedding_served_one_layer_deeper_is_caught(target, tmp_path):
    """The real failure: trained on cat([embed, layer a, layer b]), served with cat([layer a, layer b, layer c])."""
    layout = layout_for(target, [EMBED, 3, 15])
    d = export(target, tmp_path)
    # the ids a serving config ends up with when the embedding slot is dropped: in(4), in(16), in(27)
    edit_config(d / "eagle" / "config.json", eagle_aux_hidden_state_layer_ids=[4, 16, 27], eyas_layout=None)
    with pytest.raises(WiringMismatch) as e:
        check_wiring(layout, d, target, ("vllm",))
    msg = str(e.value)
    assert "eagle/config.json on vllm" in msg and "embedding not served" in msg
    assert "['out(3)', 'out(15)', 'out(26)']" in msg  # served
    assert "['embed', 'out(3)', 'out(15)']" in msg  # trained


def test_export_of_an_embedding_layout_is_served_as_trained(target, tmp_path):
    """vLLM id 0 is the embedding, so the same layout with its correct vLLM ids passes on vLLM."""
    layout = layout_for(target, [EMBED, 3, 15])
    d = export(target, tmp_path)
    as_layout(d, layout)
    got = check_wiring(layout, d, target, ("vllm",))
    assert got["served"]["vllm:eagle"] == got["served"]["vllm:speculators"] == ["embed", "out(3)", "out(15)"]


@pytest.mark.parametrize("ids, kind", [
    ([1, 14, 26], "off-by-one (one layer shallower)"),  # SpecForge output-of ids read by vLLM as input-to ids
    ([3, 16, 28], "off-by-one (one layer deeper)"),
    ([0, 15, 27], "embedding included"),
    ([5, 10, 20], "wrong layers"),
    ([2, 27], "wrong number of layers"),
])
def test_vllm_ids_that_change_the_features_are_named(target, tmp_path, ids, kind):
    layout = layout_for(target, None)
    d = export(target, tmp_path)
    edit_config(d / "eagle" / "config.json", eagle_aux_hidden_state_layer_ids=ids)
    with pytest.raises(WiringMismatch) as e:
        check_wiring(layout, d, target, ("vllm",))
    assert f"eagle/config.json on vllm: {kind}: vllm would concatenate" in str(e.value)


def test_concatenation_order_other_than_ascending_is_caught(target, tmp_path):
    layout = dataclasses.replace(layout_for(target, None), concat_order="descending")
    d = export(target, tmp_path)
    edit_config(d / "eagle" / "config.json", eyas_layout=layout.to_dict())
    with pytest.raises(WiringMismatch, match="wrong order"):
        check_wiring(layout, d, target, ("vllm",))


def test_sglang_output_of_ids_not_starting_at_one_are_refused(target, tmp_path):
    layout = layout_for(target, [2, 15, 27])
    d = export(target, tmp_path)
    as_layout(d, layout)
    assert check_wiring(layout, d, target, ("vllm",))["served"]["vllm:eagle"] == ["out(2)", "out(15)", "out(27)"]
    with pytest.raises(WiringMismatch, match="on sglang: SGLang aux ids \\[2, 15, 27\\] do not start at 1"):
        check_wiring(layout, d, target, ("vllm", "sglang"))


def test_speculators_config_without_norm_before_residual_is_refused(target, tmp_path):
    """vLLM's speculators converter defaults norm_before_residual to TRUE: omitting it changes the drafter."""
    layout = layout_for(target, None)
    d = export(target, tmp_path)
    edit_config(d / "speculators" / "config.json", norm_before_residual=None)
    with pytest.raises(WiringMismatch, match="speculators/config.json on vllm: vllm reads norm_before_residual=true"):
        check_wiring(layout, d, target)


def test_recorded_layout_and_target_must_match(target, tmp_path):
    layout = layout_for(target, None)
    d = export(target, tmp_path)
    other = dataclasses.replace(layout, aux_layers=(2, 14, 26))
    edit_config(d / "eagle" / "config.json", eyas_layout=other.to_dict())
    with pytest.raises(WiringMismatch, match="eyas_layout layout differs in aux_layers"):
        check_wiring(layout, d, target)
    foreign = dataclasses.replace(layout, target_config_hash="0" * 16)
    with pytest.raises(WiringMismatch, match="trained for another target.*target_config_hash"):
        check_wiring(foreign, d, target)

"""`eyas diagnose` reads what an export's files record before it measures any τ (#46 item 4): an eyas_layout, or a
speculators verifier, that contradicts the layer ids or the target the engine will read is the verdict, with its
fix; and where τ decides but a variant lies within the noise, the verdict says it cannot tell, with the numbers.
Configs only: no model runs."""
from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from eyas.drafter import DrafterConfig
from eyas.exports import eagle_config, speculators_config
from eyas.layout import Layout
from eyas.methods import METHODS
from services.evaluator.diagnose import (
    Exported,
    Variant,
    _config_aux,
    _recorded_checks,
    _recorded_variant,
    _write_fixed,
    verdict,
)
from services.evaluator.wiring import recorded_contradictions

L = 30  # the default aux layers are out(1), out(14), out(26): vLLM ids 2, 15, 27
ARCH = ["LlamaForCausalLM"]
VERIFIER = {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ARCH}


def _layout(aux: tuple[int, ...] = (1, 14, 26)) -> Layout:
    return Layout(target="t", target_config_hash="c", tokenizer_hash="k", num_layers=L, hidden_size=64,
                  vocab_size=1024, aux_layers=aux)


def _configs(layout: Layout) -> dict[str, dict]:
    """The eagle/ and speculators/ config.json Eyas exports for `layout`."""
    target = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=L, vocab_size=1024)
    eagle = eagle_config(DrafterConfig.from_target(target, 512, len(layout.aux_layers)), layout, "float32")
    return {"eagle": eagle, "speculators": speculators_config(eagle, layout, VERIFIER, 3, METHODS["eagle3"])}


def _shift(config: dict) -> dict:
    """vLLM's ids one deeper than the layout records (TorchSpec #87): out(i) written as vLLM's id i."""
    return {**config, "eagle_aux_hidden_state_layer_ids": [i + 2 for i in config["eyas_layout"]["aux_layers"]]}


@pytest.mark.parametrize("export", ["eagle", "speculators"])
@pytest.mark.parametrize("aux", [(1, 14, 26), (3, 9, 20)])
def test_an_export_as_written_contradicts_nothing(export, aux):
    assert recorded_contradictions(_configs(_layout(aux))[export], L, ARCH) == []


@pytest.mark.parametrize("export", ["eagle", "speculators"])
def test_vllm_ids_shifted_by_one_are_named_from_the_files_with_their_fix(export):
    [found] = recorded_contradictions(_shift(_configs(_layout())[export]), L, ARCH)
    assert found.finding == (
        "config.json has vLLM read out(2), out(15), out(27) (eagle_aux_hidden_state_layer_ids [3, 16, 28]) while its "
        "eyas_layout.aux_layers says [1, 14, 26], the layers the drafter was trained on (off-by-one (one layer "
        "deeper)); fix: set \"eagle_aux_hidden_state_layer_ids\": [2, 15, 27]")
    assert found.trained == (1, 14, 26)


def test_sglang_ids_that_contradict_the_layout_are_named():
    config = _configs(_layout((3, 9, 20)))["eagle"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 8, 19]
    [found] = recorded_contradictions(config, L, ARCH)
    assert found.finding.startswith("config.json has SGLang read out(2), out(8), out(19) (eagle_config's "
                                    "eagle_aux_hidden_state_layer_ids [2, 8, 19]) while its eyas_layout.aux_layers "
                                    "says [3, 9, 20]")
    assert found.finding.endswith("fix: set eagle_config's \"eagle_aux_hidden_state_layer_ids\": [3, 9, 20]")


def test_another_target_is_named_from_the_verifier_and_the_recorded_depth():
    config = _configs(_layout())["speculators"]
    [verifier, depth] = recorded_contradictions(config, 24, ["Qwen3ForCausalLM"])
    assert verifier.finding.startswith("the speculators config's verifier is a ['LlamaForCausalLM'] "
                                       "(HuggingFaceTB/SmolLM2-135M-Instruct) but the target is a "
                                       "['Qwen3ForCausalLM']")
    assert "records a target of 30 layers, the target has 24" in depth.finding
    assert verifier.trained is None and depth.trained is None  # no layer ids would fix it


def _exported(config: dict, tmp_path) -> Exported:
    return Exported(tmp_path, config, L, _config_aux(config, L))


def _rows(tried: list[Variant], taus: list[float]) -> list[dict]:
    return [{**asdict(v), "tau": t} for v, t in zip(tried, taus, strict=True)]


def test_the_diagnosis_reports_the_contradiction_as_its_verdict_and_writes_its_fix(tmp_path):
    exported = _exported(_shift(_configs(_layout())["eagle"]), tmp_path)
    assert exported.aux_layers == (2, 15, 27)  # what the engine will read
    _recorded_checks(exported, SimpleNamespace(config=SimpleNamespace(architectures=ARCH)))
    assert exported.recorded_aux == (1, 14, 26) and "[2, 15, 27]" in exported.static[0]
    # the known shift that feeds the recorded layers is the one the verdict points at, whatever τ says
    tried = _recorded_variant(exported, [Variant("as configured", "", "", (2, 15, 27)),
                                         Variant("aux ids +1", "", "", (3, 16, 28)),
                                         Variant("aux ids -1", "", "fix -1", (1, 14, 26))])
    assert [v.recorded for v in tried] == [False, False, True]
    sentence, chosen = verdict(_rows(tried, [1.2, 1.1, 1.21]), None, None, exported.static, None)
    assert sentence == (f"the export itself is mis-wired: {exported.static[0]} "
                        "(τ 1.200 as configured, 1.210 as recorded)")
    assert chosen["name"] == "aux ids -1"
    weights = {"fc.weight": torch.zeros(64, 192), "d2t": torch.zeros(512, dtype=torch.int64)}
    assert _write_fixed(exported, chosen, weights, tmp_path / "fixed") == ["eagle_aux_hidden_state_layer_ids"]
    fixed = json.loads((tmp_path / "fixed" / "config.json").read_text())
    assert recorded_contradictions(fixed, L, ARCH) == []


def test_recorded_layers_no_shift_reaches_are_a_variant_of_their_own(tmp_path):
    config = _configs(_layout((3, 9, 20)))["eagle"]
    config["eagle_aux_hidden_state_layer_ids"] = [2, 11, 25]
    exported = _exported(config, tmp_path)
    _recorded_checks(exported, SimpleNamespace(config=SimpleNamespace(architectures=ARCH)))
    [extra] = _recorded_variant(exported, [])
    assert (extra.name, extra.aux_layers, extra.recorded) == ("as recorded", (3, 9, 20), True)
    assert "\"eagle_aux_hidden_state_layer_ids\": [4, 10, 21] (vLLM)" in extra.fix


def test_a_variant_within_the_noise_is_cannot_tell_with_the_numbers():
    tried = [Variant("as configured", "", "", (1, 14, 26)), Variant("aux ids +1", "c", "f", (2, 15, 27)),
             Variant("aux ids -1", "c", "f", (0, 13, 25))]
    sentence, chosen = verdict(_rows(tried, [1.05, 1.07, 0.9]), None, None, [], None)
    assert sentence.startswith("cannot tell at this τ: 1.050 in-process as configured, and 'aux ids +1' 1.070, "
                               "within the ±0.030 this measure resolves") and chosen == {}
    # every variant clearly worse: then, and only then, nothing is mis-wired
    sentence, _ = verdict(_rows(tried, [1.5, 1.2, 1.1]), None, None, [], None)
    assert sentence.startswith("no mis-wiring found: τ 1.500 in-process")


def test_a_recorded_layout_of_another_target_is_named(tmp_path):
    """Ids that agree with the recorded layout, but a target whose config differs from the one it records."""
    exported = _exported(_configs(_layout())["eagle"], tmp_path)
    target = SimpleNamespace(name="other", config_hash="not-c", tokenizer_hash="k", num_layers=L, hidden_size=64,
                             config=SimpleNamespace(vocab_size=1024, architectures=ARCH))
    _recorded_checks(exported, target)
    [finding] = exported.static
    assert "target_config_hash: expected 'c', got 'not-c'" in finding and finding.endswith("with that target")
    assert exported.recorded_aux is None  # no layer ids would fix it

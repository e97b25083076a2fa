"""Extractor: captured aux states are the target's own hidden states at the layout's boundaries, shards carry
the layout, and every reader refuses features of another layout."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from eyas.capture import Captured, ZeroState, capture
from eyas.features import FeatureReader, Sample, ShardBuffer, dequantize, quantize, shard_samples
from eyas.layout import (
    AUX_HIDDEN,
    AUX_SCALE,
    FINAL_HIDDEN,
    FINAL_SCALE,
    FP8,
    OFFSETS,
    Layout,
    LayoutMismatch,
    default_aux_layers,
)
from eyas.manifest import MANIFEST, read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target, resolve_target
from orchestration.embedded import EmbeddedRunner
from services.extractor.core import layout_for
from services.extractor.vllm_backend import CaptureEngine, EngineConfig
from tests.datasets import write_dataset


@pytest.fixture(scope="module")
def target():
    return load_target(BUNDLED)


def test_capture_equals_the_targets_own_hidden_states(target):
    layout = layout_for(target, None)
    assert layout.aux_layers == (1, 14, 26) == default_aux_layers(30)  # out(1), out(L//2-1), out(L-4)
    ids = torch.tensor([[1, 504, 3458, 28, 2], [1, 7, 9, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    aux, final = capture(target, layout, ids, attn)
    with torch.inference_mode():
        ref = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
    H = target.hidden_size
    for j, i in enumerate(layout.aux_layers):  # ascending; HF hidden_states[i+1] is out(i)
        assert torch.equal(aux[..., j * H:(j + 1) * H], ref[i + 1])
    assert not any(torch.equal(aux[..., j * H:(j + 1) * H], ref[0]) for j in range(3))  # no embedding
    assert torch.equal(final, ref[-1])  # final norm output
    assert aux.shape == (2, 5, 3 * H)


def test_extract_writes_layout_checked_shards(tmp_path):
    data = write_dataset(tmp_path / "data")
    job = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
        "extract", {"data": data, "shard_mb": 1}, output_dir=tmp_path / "feat")[0]
    assert job.state == "succeeded"
    art = open_artifact(str(tmp_path / "feat"))
    m = read_manifest(art, kind="features")
    assert m.counts["samples"] == 6 and m.counts["shards"] >= 1
    assert m.layout["aux_layers"] == [1, 14, 26] and m.layout["convention"] == "out"
    reader = FeatureReader(art, expected=Layout.from_dict(m.layout))
    samples = list(reader.samples())
    assert len(samples) == 6
    s = samples[0]
    assert s.aux_hidden.shape == (len(s.input_ids), 3 * 576) and s.aux_hidden.dtype == torch.bfloat16
    assert s.final_hidden.shape == (len(s.input_ids), 576)
    assert 0 < int(s.loss_mask.sum()) < len(s.input_ids)
    shard = reader.load_shard(reader.shards[0])
    per_token = (shard[AUX_HIDDEN].nbytes + shard[FINAL_HIDDEN].nbytes) / shard[AUX_HIDDEN].shape[0]
    assert per_token == (3 + 1) * 576 * 2

    other = Layout.from_dict({**m.layout, "aux_layers": [2, 15, 27]})
    with pytest.raises(LayoutMismatch, match="aux_layers"):
        FeatureReader(art, expected=other)


def test_shards_stay_within_shard_mb(tmp_path):
    """A shard closes before the sample that would take it past shard_mb, inside a forward batch too; only a sample
    bigger than shard_mb on its own passes it, alone in its shard, warned and counted in the manifest."""
    convs = [(f"Question {i}?", "word " * (20 + 15 * i)) for i in range(7)] + [("Long?", "word " * 400)]
    data = write_dataset(tmp_path / "data", conversations=convs)
    job = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
        "extract", {"data": data, "shard_mb": 1, "batch_tokens": 8192}, output_dir=tmp_path / "feat")[0]
    assert job.state == "succeeded"
    reader = FeatureReader(open_artifact(str(tmp_path / "feat")))
    samples = {name: len(reader.load_shard(name)[OFFSETS]) - 1 for name in reader.shards}
    assert sum(samples.values()) == len(convs) and len(samples) >= 3  # one forward batch (8192 tokens), split
    over = {name for name, size in reader.sizes.items() if size > 1 << 20}
    assert len(over) == 1 and all(samples[name] == 1 for name in over)  # the long sample's, alone
    assert sum(s.input_ids.numel() for s in reader.samples()) == read_manifest(reader.artifact).counts["tokens"]
    assert read_manifest(reader.artifact).counts["samples_over_shard_mb"] == 1


def test_a_failing_capture_engine_is_reported_with_its_logs_last_lines(tmp_path, capfd):
    """The capture engine's own output goes to a log file, not to the terminal; an engine that dies is reported
    with that file's path and last lines. (Fault injection: this environment's Python, which has no vLLM.)"""
    config = EngineConfig(python=sys.executable, target=str(resolve_target(BUNDLED)), aux_layers=(1, 14, 26),
                          num_layers=30, dtype="float32", tensor_parallel_size=1, max_model_len=64)
    with pytest.raises(RuntimeError, match="capture engine exited") as failed:
        CaptureEngine(config, check=lambda: None, log_dir=tmp_path / "logs")
    [log] = (tmp_path / "logs").iterdir()
    assert "No module named 'vllm'" in log.read_text()  # the engine's traceback, in its log
    assert str(log) in str(failed.value) and "No module named 'vllm'" in str(failed.value)
    assert "No module named" not in capfd.readouterr().err  # nothing of it on this process's stderr


def test_wrong_tokenizer_dataset_refused(tmp_path):
    data = write_dataset(tmp_path / "data", tok_hash="0123456789abcdef")
    with pytest.raises(ValueError, match="tokenizer/template"):
        EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
            "extract", {"data": data}, output_dir=tmp_path / "f")
    assert not (tmp_path / "f" / "manifest.json").exists()


def test_overlong_and_empty_policies_are_counted(tmp_path):
    convs = [("Hi", "Hello there, how can I help you today?"), ("Empty?", ""), ("Long", "word " * 80)]
    data = write_dataset(tmp_path / "data", conversations=convs)
    for policy, samples in (("truncate", 2), ("skip", 1)):
        out = tmp_path / policy
        EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
            "extract", {"data": data, "max_length": 60, "overlong": policy}, output_dir=out)
        counts = json.loads((out / "manifest.json").read_text())["counts"]
        assert counts["samples"] == samples and counts["skipped_empty"] == 1
        assert counts["truncated" if policy == "truncate" else "skipped_overlong"] == 1


def test_nan_activation_fails_naming_the_sample(tmp_path, monkeypatch):
    import services.extractor.shards as shards

    real = shards.capture

    def poisoned(target, layout, ids, attn, **kw):  # fault injection: a NaN in one activation
        aux, final = real(target, layout, ids, attn, **kw)
        aux = aux.clone()
        aux[0, 0, 0] = float("nan")
        return aux, final

    monkeypatch.setattr(shards, "capture", poisoned)
    data = write_dataset(tmp_path / "data", conversations=[("Hi", "Hello!")])
    with pytest.raises(ValueError, match="sample 't0'.*NaN"):
        EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
            "extract", {"data": data}, output_dir=tmp_path / "f")
    assert not (tmp_path / "f" / "manifest.json").exists()


def test_an_all_zero_captured_state_fails_naming_the_layer_and_the_target(tmp_path, monkeypatch):
    """An engine that leaves a layer's state unfilled (vLLM's Qwen3-Next before its fix, vllm#36527) hands back
    zeros for it: here the real capture with out(14)'s columns zeroed. The extraction fails naming that layer
    and the target, with no features written."""
    import services.extractor.shards as shards

    real = shards.capture

    def unfilled(target, layout, ids, attn, **kw):
        aux, final = real(target, layout, ids, attn, **kw)
        H, j = target.hidden_size, layout.aux_layers.index(14)
        aux = aux.clone()
        aux[..., j * H:(j + 1) * H] = 0
        return aux, final

    monkeypatch.setattr(shards, "capture", unfilled)
    data = write_dataset(tmp_path / "data", conversations=[("Hi", "Hello!")])
    with pytest.raises(ZeroState, match=rf"sample 't0': target {BUNDLED!r} captured all-zero states at out\(14\) "):
        EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
            "extract", {"data": data}, output_dir=tmp_path / "f")
    assert not (tmp_path / "f" / "manifest.json").exists()


def test_check_nonzero_names_every_dead_state_and_passes_live_ones():
    """Per sample: a state zero on some tokens only is live; one zero on all of them is named, the final norm's
    too; every state live passes."""
    captured = Captured("some/target", (1, 3, 4))
    aux, final = torch.randn(5, 3 * 8), torch.randn(5, 8)
    aux[:4] = 0  # every layer zero on 4 of 5 tokens: still live
    captured.check_nonzero("s", aux, final)
    aux[:, 8:16] = 0
    with pytest.raises(ZeroState, match=r"'some/target' captured all-zero states at out\(3\) "):
        captured.check_nonzero("s", aux, final)
    with pytest.raises(ZeroState, match=r"at out\(3\), final norm "):
        captured.check_nonzero("s", aux, torch.zeros(5, 8))


REASONING_CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Add two and two.", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "Add three and three.", "content": "6"}]


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_turns_become_the_samples_the_server_saw(tmp_path, thinking):
    """A tiny Qwen3 target (its template drops earlier reasoning): a two-turn conversation with reasoning becomes
    one sample per turn, rendered with the dataset's chat template kwargs, which the features record. With
    thinking off, reasoning cannot have been generated: that conversation is skipped and counted."""
    from eyas.render import render_conversation
    from tests.datasets import write_records
    from tests.families import FAMILIES, build_target

    target = str(build_target(FAMILIES["qwen3"], tmp_path / "qwen3"))
    kwargs = {"enable_thinking": thinking}
    records = [{"id": "a", "messages": REASONING_CONVERSATION},
               {"id": "b", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}]
    data = write_records(tmp_path / "data", records, target=target, chat_template_kwargs=kwargs)
    [job] = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path])).run_job(
        "extract", {"data": data, "target": target}, output_dir=tmp_path / "feat")
    assert job.state == "succeeded", job.error
    art = open_artifact(str(tmp_path / "feat"))
    m = read_manifest(art, kind="features")
    assert m.features.chat_template_kwargs == kwargs
    ids = art.get_bytes("samples.txt").decode().split()
    if thinking:
        assert sorted(ids) == ["a", "a#1", "b"] and m.counts["split_conversations"] == 1
    else:
        assert ids == ["b"] and m.counts["skipped_unrenderable"] == 1
    # each stored sample is exactly what eyas.render makes of its conversation with the dataset's kwargs
    tok = load_target(target).tokenizer
    expected = {rid: r.input_ids for rec in records if rec["id"] in {i.split("#")[0] for i in ids}
                for n, r in enumerate(render_conversation(tok, rec["messages"], kwargs))
                for rid in [rec["id"] if n == 0 else f"{rec['id']}#{n}"]}
    stored = dict(zip(ids, FeatureReader(art).samples(), strict=True))
    assert {k: s.input_ids.tolist() for k, s in stored.items()} == expected


# ---------------------------------------------------------------- fp8 features


def within_e4m3(got: torch.Tensor, want: torch.Tensor, states: int) -> bool:
    """Each value within e4m3's rounding (3 mantissa bits: 2^-4 of itself) plus bf16's (2^-8), or, where it is
    below e4m3's normal range, 2^-10 of its state row's amax (a row below ~5e-36 is stored as zeros)."""
    want = want.float().reshape(want.shape[0], states, -1)
    amax = want.abs().amax(-1, keepdim=True)
    err = (got.float().reshape(want.shape) - want).abs()
    return bool((err <= (2**-4 + 2**-8) * want.abs() + 2**-10 * amax + 448 * torch.finfo(torch.float32).tiny).all())


def test_fp8_round_trip_keeps_each_state_within_e4m3_error_and_zero_rows_zero(tmp_path):
    g = torch.Generator().manual_seed(0)
    T, H = 32, 64
    # states of very different magnitudes (a deep layer's residual is ~100× a shallow one's), a few outliers
    aux = torch.randn(T, 3, H, generator=g) * torch.tensor([0.05, 3.0, 400.0])[:, None]
    aux[5, 1, 7] = 9000.0
    aux = aux.reshape(T, 3 * H).bfloat16()
    final = (torch.randn(T, H, generator=g) * 2).bfloat16()
    aux[0], final[0] = 0, 0  # an all-zero token (padding)
    aux[1, H:2 * H] = 0  # one all-zero state of a token
    aux[2, :H] = 1e-38  # one so small (bf16 subnormal) that its scale has no float32 inverse
    q, scale = quantize(aux, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (T, 3) and scale.dtype == torch.float32
    assert within_e4m3(dequantize(q, scale), aux, 3)

    buf = ShardBuffer(dtype=FP8)
    buf.add(Sample(torch.arange(T), torch.ones(T, dtype=torch.long), aux, final))
    buf.add(Sample(torch.arange(4), torch.ones(4, dtype=torch.long), torch.zeros(4, 3 * H), torch.zeros(4, H)))
    buf.write(tmp_path / "s.safetensors")
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "s.safetensors"))
    assert t[AUX_HIDDEN].dtype == t[FINAL_HIDDEN].dtype == torch.float8_e4m3fn
    assert t[AUX_SCALE].shape == (T + 4, 3) and t[FINAL_SCALE].shape == (T + 4, 1)
    first, zeros = shard_samples(t)
    assert first.aux_hidden.dtype == first.final_hidden.dtype == torch.bfloat16  # what every reader gets
    assert within_e4m3(first.aux_hidden, aux, 3) and within_e4m3(first.final_hidden, final, 1)
    assert (first.aux_hidden[0] == 0).all() and (first.final_hidden[0] == 0).all()
    assert (first.aux_hidden[1, H:2 * H] == 0).all() and torch.isfinite(first.aux_hidden.float()).all()
    assert (first.aux_hidden[2, :H].float().abs() <= 1e-38).all()
    assert (zeros.aux_hidden == 0).all() and (zeros.final_hidden == 0).all()


def test_fp8_features_take_half_the_bytes_read_back_as_bf16_ones_and_train(tmp_path):
    """The same extract job with features_dtype fp8: ≤ 0.52× the bytes per token on the real files, the same
    samples within e4m3's error, streamed to a train job (the hand-off) that trains on them; a shard stored
    otherwise than its layout says is refused."""
    data = write_dataset(tmp_path / "data")
    emb = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))
    job = emb.run_job("extract", {"data": data}, output_dir=tmp_path / "bf16")[0]
    assert job.state == "succeeded", job.error
    train = {"stage": "train", "ttt_steps": 2, "draft_vocab_size": 256, "batch_tokens": 256, "steps": 4,
             "warmup": 1, "val_every": 3, "cache_gb": 1.0}
    ext, trn = emb.run_job("extract", {"data": data, "features_dtype": FP8, "then": [train],
                                       "stream": {"policy": "first_epoch", "max_store_gb": 1.0}},
                           output_dir=tmp_path / "fp8")
    assert (ext.state, trn.state) == ("succeeded", "succeeded"), (ext.error, trn.error)
    assert json.loads(open_artifact(trn.artifacts["output"]).get_bytes("manifest.json"))["counts"]["steps"] == 4

    bf16, fp8 = (FeatureReader(open_artifact(str(tmp_path / d))) for d in ("bf16", "fp8"))
    assert fp8.layout.dtype == FP8 and bf16.layout.dtype == "bfloat16"
    assert fp8.layout == Layout.from_dict({**bf16.layout.to_dict(), "dtype": FP8})
    tokens = sum(len(s.input_ids) for s in bf16.samples())
    per_token = {r.layout.dtype: sum(r.manifest.files[n].bytes for n in r.shards) / tokens for r in (bf16, fp8)}
    assert per_token[FP8] <= 0.52 * per_token["bfloat16"], per_token
    for a, b in zip(bf16.samples(), fp8.samples(), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert b.aux_hidden.dtype == torch.bfloat16
        assert within_e4m3(b.aux_hidden, a.aux_hidden, 3) and within_e4m3(b.final_hidden, a.final_hidden, 1)

    # fp8 shards under a layout that says bf16: refused, naming both
    art = open_artifact(str(tmp_path / "fp8"))
    manifest = json.loads(art.get_bytes(MANIFEST))
    manifest["layout"]["dtype"] = "bfloat16"
    art.put_bytes(MANIFEST, json.dumps(manifest).encode())
    reader = FeatureReader(art)
    with pytest.raises(LayoutMismatch, match="aux_hidden is stored as float8_e4m3fn, but the features' layout "
                                             "says bfloat16"):
        next(reader.samples())
    manifest["layout"]["dtype"] = "float16"
    art.put_bytes(MANIFEST, json.dumps(manifest).encode())
    with pytest.raises(LayoutMismatch, match="'float16', which this reader does not read"):
        FeatureReader(art)

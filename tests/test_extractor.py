"""Extractor: captured aux states are the target's own hidden states at the layout's boundaries, shards carry
the layout, and every reader refuses features of another layout."""
from __future__ import annotations

import json

import pytest
import torch

from eyas.embedded import Embedded
from eyas.features import FeatureReader
from eyas.layout import AUX_HIDDEN, FINAL_HIDDEN, Layout, LayoutMismatch, default_aux_layers
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target
from services.extractor.capture import capture
from services.extractor.core import layout_for
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
    job = Embedded(Settings(workdir=tmp_path / "w")).run_job(
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


def test_wrong_tokenizer_dataset_refused(tmp_path):
    data = write_dataset(tmp_path / "data", tok_hash="0123456789abcdef")
    with pytest.raises(ValueError, match="tokenizer/template"):
        Embedded(Settings(workdir=tmp_path / "w")).run_job("extract", {"data": data}, output_dir=tmp_path / "f")
    assert not (tmp_path / "f" / "manifest.json").exists()


def test_overlong_and_empty_policies_are_counted(tmp_path):
    convs = [("Hi", "Hello there, how can I help you today?"), ("Empty?", ""), ("Long", "word " * 80)]
    data = write_dataset(tmp_path / "data", conversations=convs)
    for policy, samples in (("truncate", 2), ("skip", 1)):
        out = tmp_path / policy
        Embedded(Settings(workdir=tmp_path / "w")).run_job(
            "extract", {"data": data, "max_length": 60, "overlong": policy}, output_dir=out)
        counts = json.loads((out / "manifest.json").read_text())["counts"]
        assert counts["samples"] == samples and counts["skipped_empty"] == 1
        assert counts["truncated" if policy == "truncate" else "skipped_overlong"] == 1


def test_nan_activation_fails_naming_the_sample(tmp_path, monkeypatch):
    import services.extractor.core as core

    real = core.capture

    def poisoned(target, layout, ids, attn):  # fault injection: a NaN in one activation
        aux, final = real(target, layout, ids, attn)
        aux = aux.clone()
        aux[0, 0, 0] = float("nan")
        return aux, final

    monkeypatch.setattr(core, "capture", poisoned)
    data = write_dataset(tmp_path / "data", conversations=[("Hi", "Hello!")])
    with pytest.raises(ValueError, match="sample 't0'.*NaN"):
        Embedded(Settings(workdir=tmp_path / "w")).run_job("extract", {"data": data}, output_dir=tmp_path / "f")
    assert not (tmp_path / "f" / "manifest.json").exists()

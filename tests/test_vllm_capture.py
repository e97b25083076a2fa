"""The extract stage's vLLM engine (services.extractor.vllm_backend) against its transformers path, on the bundled
target: the same artifact (sample ids, tokens, loss masks, offsets exactly; features within bf16 rounding, or
e4m3's for fp8 features), the engine recorded in the manifest, one engine process for the jobs after the first, a
features stream fed by it, tensor parallel capture (two CPU ranks) agreeing too, and `engine: vllm` without a vLLM
environment refused by name.
tests/test_families.py runs the same agreement on every family, and serves a drafter trained on vLLM-captured
features."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eyas.features import FeatureReader
from eyas.layout import FP8
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from eyas.target import load_tokenizer, tokenizer_hash
from orchestration.embedded import EmbeddedRunner
from services.extractor import vllm_backend
from tests.datasets import CONVERSATIONS, write_dataset
from tests.families import FAMILIES, build_target

pytestmark = pytest.mark.vllm

# bf16 keeps 8 significant bits: rounding moves a value by at most 2^-9 of it, so a token's states by at most
# 2^-9 of their norm; two engines computing the same fp32 states agree that closely once both are stored
BF16_ROUNDING = 2.0 ** -9
E4M3_ROUNDING = 2.0 ** -4 + 2.0 ** -8  # fp8 features: e4m3 keeps 4 significant bits, then bf16 on reading


def samples_of(uri: str) -> dict[str, dict[str, torch.Tensor]]:
    """sample id → its tensors (samples.txt lists the ids in the artifact's order)."""
    artifact = open_artifact(uri)
    ids = artifact.get_bytes("samples.txt").decode().split()
    samples = list(FeatureReader(artifact).samples())
    assert len(ids) == len(samples)
    return {i: {"input_ids": s.input_ids, "loss_mask": s.loss_mask, "aux": s.aux_hidden, "final": s.final_hidden}
            for i, s in zip(ids, samples, strict=True)}


def assert_same_features(ours: str, reference: str, hidden: int, rounding: float = BF16_ROUNDING) -> float:
    """Same samples, tokens and masks exactly; every token's states (each aux layer, and the final one) within
    `rounding` (bf16's) of the reference's. Returns the largest per-token relative error."""
    a, b = samples_of(ours), samples_of(reference)
    assert a.keys() == b.keys()
    worst = 0.0
    for sid, x in a.items():
        y = b[sid]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), sid
        for name in ("aux", "final"):
            u = x[name].float().view(x[name].shape[0], -1, hidden)  # [T, layers, H]
            v = y[name].float().view(u.shape)
            rel = (u - v).norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-12)
            worst = max(worst, float(rel.max()))
    assert worst <= rounding, f"a token's states differ by {worst:.2e} of their norm (allowed: {rounding:.1e})"
    return worst


# one long conversation beside the short ones: a prompt the engine prefills in several chunks
LONG = ("Tell me everything about rivers.", " ".join(["Rivers carry water and stones to the sea."] * 60))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-capture")
    write_dataset(root / "data", [*CONVERSATIONS, LONG])
    return root


def extract(root: Path, engine: str, name: str, **spec) -> tuple[str, dict]:
    runner = EmbeddedRunner(Settings(workdir=root / "work", input_roots=[root], extract_engine=None))
    [job] = runner.run_job("extract", {"data": str(root / "data"), "engine": engine, "batch_tokens": 512, **spec},
                           output_dir=root / name)
    assert job.state == "succeeded", job.error
    return job.artifacts["output"], read_manifest(open_artifact(job.artifacts["output"]), kind="features").extra


def test_vllm_capture_writes_the_transformers_artifact_within_bf16_rounding(data):
    reference, ref_extra = extract(data, "transformers", "hf")
    ours, extra = extract(data, "vllm", "vllm")
    assert ref_extra["compute"]["engine"] == "transformers"
    engine_log = Path(extra["compute"].pop("engine_log"))
    assert extra["compute"] == {"engine": "vllm", "device": "cpu", "tensor_parallel_size": 1, "dtype": "float32"}
    assert engine_log.parent == data / "work" / "logs" and engine_log.stat().st_size > 0  # the engine's own output
    worst = assert_same_features(ours, reference, hidden=576)
    print(f"largest per-token relative difference: {worst:.1e}")
    engine = vllm_backend._engine
    assert engine is not None and engine.proc.poll() is None  # kept for the next job
    # the next job, with fp8 features: the same engine (how shards store the states is a job's, not the engine's)
    again, again_extra = extract(data, "vllm", "vllm-again", features_dtype=FP8)
    assert vllm_backend._engine is engine  # no second engine start
    assert again_extra["compute"]["engine_log"] == str(engine_log)  # its log, recorded by every job it serves
    assert FeatureReader(open_artifact(again)).layout.dtype == FP8
    assert_same_features(again, reference, hidden=576, rounding=E4M3_ROUNDING)


def test_a_features_stream_from_the_vllm_engine(data):
    """An extract job with a stream and a train job beside it, the shards captured by the engine."""
    spec = {"shard_mb": 1, "stream": {"policy": "first_epoch", "max_store_gb": 0.01}}
    runner = EmbeddedRunner(Settings(workdir=data / "work", input_roots=[data], extract_engine=None))
    jobs = runner.run_job("extract", {"data": str(data / "data"), "engine": "vllm", "batch_tokens": 256, **spec,
                                      "then": [{"stage": "train", "ttt_steps": 1, "draft_vocab_size": 256,
                                                "batch_tokens": 256, "steps": 4, "warmup": 1, "val_interval": 0,
                                                "cache_gb": 0.01}]})
    assert [(j.stage, j.state) for j in jobs] == [("extract", "succeeded"), ("train", "succeeded")], \
        [j.error for j in jobs]
    features = read_manifest(open_artifact(jobs[0].artifacts["output"]), kind="features")
    assert features.extra["compute"]["engine"] == "vllm" and features.extra["policy"]["features"] == "first_epoch"


def test_tensor_parallel_capture_writes_the_transformers_artifact(data):
    """tensor_parallel_size 2 on the CPU (two vLLM worker processes, a core each): every rank captures, rank 0's
    states are taken; on the Llama-3 family target (4 query and 2 key/value heads: a half on each rank), the same
    artifact as transformers' hooks within bf16 rounding, aux and final states alike."""
    target = str(build_target(FAMILIES["llama3"], data / "llama3"))
    spec = {"target": target, "data": write_dataset(data / "llama3-data", [*CONVERSATIONS, LONG],
                                                    tok_hash=tokenizer_hash(load_tokenizer(target)))}
    reference, _ = extract(data, "transformers", "tp-hf", **spec)
    try:
        ours, extra = extract(data, "vllm", "tp2", **spec, tensor_parallel_size=2)
        assert extra["compute"]["tensor_parallel_size"] == 2
    finally:  # its two worker processes go now, not at the session's end
        engine = vllm_backend._engine
        vllm_backend.release_engine()
        assert vllm_backend._engine is None and (engine is None or engine.proc.poll() is not None)
    worst = assert_same_features(ours, reference, hidden=FAMILIES["llama3"].config["hidden_size"])
    print(f"largest per-token relative difference: {worst:.1e}")


def test_engine_vllm_without_a_vllm_environment_fails_naming_it(data):
    runner = EmbeddedRunner(Settings(workdir=data / "none-work", input_roots=[data], vllm_python=None,
                                     extract_engine=None))
    with pytest.raises(vllm_backend.EngineUnavailable, match="no vLLM environment here"):
        runner.run_job("extract", {"data": str(data / "data"), "engine": "vllm"}, output_dir=data / "none")
    [failed] = runner.jobs.list(stage="extract", state="failed")
    assert "no vLLM environment here" in failed.error
    [job] = runner.run_job("extract", {"data": str(data / "data"), "engine": "auto"}, output_dir=data / "auto")
    assert job.state == "succeeded"  # auto falls back to transformers, and says so
    assert read_manifest(open_artifact(job.artifacts["output"]), kind="features").extra["compute"]["engine"] == \
        "transformers"

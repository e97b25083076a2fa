"""An extract job in service mode: conversations in S3 (SeaweedFS), job record in Redis, features back in S3 — with
transformers, and with the engine a deployment gets by default (vLLM's capture engine, where its environment is
installed), which writes the shards into the bucket from vLLM's own environment."""
from __future__ import annotations

import pytest

from eyas.features import FeatureReader
from eyas.manifest import read_manifest
from eyas.store import S3Store, open_artifact
from orchestration.execution import execute, submit
from orchestration.jobs import RedisJobStore
from tests.datasets import write_dataset


def _worker_settings(service_settings, monkeypatch, **env: str | None):
    """The settings of a worker process configured by EYAS_* variables: the test's, changed by `env` (None: unset)."""
    from eyas.settings import get_settings

    for k, v in {**service_settings.env, **env}.items():
        if k.startswith("EYAS_"):
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, v)
    from orchestration.settings import ServiceSettings

    get_settings.cache_clear()  # a stage reads them too (eyas.settings.get_settings)
    return ServiceSettings()


def test_extract_job_on_redis_and_s3(tmp_path, service_settings, monkeypatch):
    from eyas.settings import get_settings

    settings = _worker_settings(service_settings, monkeypatch)
    store, jobs = S3Store(settings), RedisJobStore(settings.redis_url)
    write_dataset(tmp_path / "data")
    for f in (tmp_path / "data").iterdir():
        store.put_file(f"datasets/upload/{f.name}", f)
    queued: list[tuple[str, str]] = []
    job = submit("extract", {"data": f"s3://{settings.s3_bucket}/datasets/upload", "then": ["train"]}, jobs,
                 lambda stage, job_id: queued.append((stage, job_id)), settings)
    assert queued == [("extract", job.id)]
    done = execute(job.id, jobs, store, settings, lambda stage, job_id: queued.append((stage, job_id)))
    assert done.state == "succeeded", done.error
    uri = done.artifacts["output"]
    assert uri == f"s3://{settings.s3_bucket}/features/{job.id}"
    reader = FeatureReader(open_artifact(uri, settings))
    assert reader.manifest.counts["samples"] == 6 and reader.manifest.inputs == [job.spec["data"]]
    assert len(list(reader.samples())) == 6
    assert queued[-1][0] == "train" and jobs.get(queued[-1][1]).spec["features"] == uri  # hand-off to the trainer
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.mark.vllm
def test_the_default_engine_extracts_into_the_bucket(tmp_path, service_settings, monkeypatch):
    """A deployment that names no engine extracts with vLLM where its environment is installed (.venv-vllm here): the
    engine, in that environment, uploads the shards to S3 itself (it died at its first upload while the environment
    lacked what eyas.store imports)."""
    from eyas.settings import get_settings
    from services.extractor import vllm_backend

    settings = _worker_settings(service_settings, monkeypatch, EYAS_EXTRACT_ENGINE=None)
    assert settings.extract_engine is None and settings.vllm_python is not None and settings.vllm_python.exists()
    store, jobs = S3Store(settings), RedisJobStore(settings.redis_url)
    write_dataset(tmp_path / "data")
    for f in (tmp_path / "data").iterdir():
        store.put_file(f"datasets/upload/{f.name}", f)
    job = submit("extract", {"data": f"s3://{settings.s3_bucket}/datasets/upload", "batch_tokens": 512}, jobs,
                 lambda *_: None, settings)
    try:
        done = execute(job.id, jobs, store, settings, lambda *_: None)
    finally:
        if vllm_backend._engine is not None:  # the engine is the machine's biggest process: not kept for later tests
            vllm_backend._engine.close()
            vllm_backend._engine = None
    assert done.state == "succeeded", done.error
    features = open_artifact(done.artifacts["output"], settings)
    assert read_manifest(features, kind="features").extra["compute"]["engine"] == "vllm"
    shards = [n for n in store.list(f"features/{job.id}") if n.endswith(".safetensors") and "shard-" in n]
    assert shards  # the engine's uploads, in the bucket
    assert len(list(FeatureReader(features).samples())) == 6
    monkeypatch.undo()
    get_settings.cache_clear()

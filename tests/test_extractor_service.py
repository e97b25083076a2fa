"""An extract job in service mode: conversations in S3 (SeaweedFS), job record in Redis, features back in S3."""
from __future__ import annotations

from eyas.features import FeatureReader
from eyas.store import S3Store, open_artifact
from orchestration.execution import execute, submit
from orchestration.jobs import RedisJobStore
from tests.datasets import write_dataset


def test_extract_job_on_redis_and_s3(tmp_path, service_settings, monkeypatch):
    from eyas.settings import get_settings

    for k, v in service_settings.env.items():  # configured like a worker process: by EYAS_* variables
        if k.startswith("EYAS_"):
            monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    settings = get_settings()
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

"""Extraction on every GPU and without stalls: N extractor processes write the features one process writes, and
the background writer keeps order and hands its failures to the extracting thread."""
from __future__ import annotations

import threading
import time

import pytest

from eyas.features import FeatureReader
from eyas.manifest import read_manifest
from eyas.settings import Settings
from eyas.store import open_artifact
from orchestration.embedded import EmbeddedRunner
from services.extractor.offload import Background
from tests.datasets import CONVERSATIONS, write_records
from tests.families import FAMILIES, build_target


def test_background_runs_jobs_in_order_off_the_calling_thread():
    done: list[tuple[int, str]] = []
    with Background(depth=2) as background:
        for i in range(20):
            background.submit(lambda i=i: done.append((i, threading.current_thread().name)))
    assert [i for i, _ in done] == list(range(20))
    assert {name for _, name in done} == {"eyas-extract-writer"}


def test_a_failed_job_is_raised_in_the_caller_and_the_rest_dropped():
    ran: list[int] = []

    def job(i: int) -> None:
        if i == 3:
            raise ValueError("sample 's3': non-finite")
        ran.append(i)

    with pytest.raises(ValueError, match="s3"), Background(depth=1) as background:
        for i in range(50):
            background.submit(lambda i=i: job(i))
            time.sleep(0.001)
    assert ran[:3] == [0, 1, 2] and 3 not in ran and len(ran) < 49  # raised at a later submit, not at the end

    with pytest.raises(ValueError, match="last"), Background() as background:
        background.submit(lambda: (_ for _ in ()).throw(ValueError("last")))  # raised when the block ends


def test_a_failing_caller_keeps_its_exception_and_drops_waiting_jobs():
    ran: list[int] = []
    with pytest.raises(KeyError), Background(depth=4) as background:
        background.submit(lambda: time.sleep(0.2))
        for i in range(3):
            background.submit(lambda i=i: ran.append(i))
        raise KeyError("cancelled")
    assert ran == []


def test_two_extractor_processes_write_the_features_of_one(tmp_path):
    """torchrun with 2 ranks (each every other shard of the same plan) vs one process: the same shards, byte for
    byte, the same sample order and counts."""
    target = str(build_target(FAMILIES["llama3"], tmp_path / "llama3"))
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": q},
                                            {"role": "assistant", "content": f"{a} " * (3 + i % 6)}]}
               for i, (q, a) in enumerate(CONVERSATIONS * 14)]
    data = write_records(tmp_path / "data", records, target=target)
    runner = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))
    spec = {"data": data, "target": target, "shard_mb": 1, "batch_tokens": 512}
    for n in (1, 2):
        [job] = runner.run_job("extract", {**spec, "processes": n}, output_dir=tmp_path / f"p{n}")
        assert job.state == "succeeded", job.error
    one, two = (open_artifact(str(tmp_path / f"p{n}")) for n in (1, 2))
    m1, m2 = (read_manifest(a, kind="features") for a in (one, two))
    assert m1.counts["shards"] >= 3  # both ranks had shards to write
    assert m1.files == m2.files and m1.counts == m2.counts and m1.layout == m2.layout
    assert m2.extra["compute"]["processes"] == 2 and m1.extra["compute"]["processes"] == 1
    assert one.get_bytes("samples.txt") == two.get_bytes("samples.txt")
    samples = list(FeatureReader(two).samples())
    assert len(samples) == m2.counts["samples"] == len(records)

"""Extraction and training in flight together (eyas.handoff): the extractor and the trainer run as separate
processes on one features artifact, the trainer on shards as they land. Under recompute the store never holds more
than the cap, with features 4× the cap; kill -9 of the trainer and of the extractor mid-stream, then running each
again, trains on every sample once per epoch and gives the drafter an uninterrupted run gives."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eyas.handoff import CONSUMED, FINISHED, STREAM, read_plan
from eyas.manifest import read_manifest
from eyas.store import open_artifact
from services.trainer.checkpoint import read_latest
from tests.datasets import write_records

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river carries light stones past quiet farms while herons wait in reeds and a slow boat drifts "
         "toward the old mill where children count fish").split()


def conversations(n: int) -> list[dict]:
    out = []
    for i in range(n):
        answer = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(20 + (i * 13) % 40))
        out.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me story number {i}."},
                                                {"role": "assistant", "content": answer}]})
    return out


def start(stage: str, spec: dict, output: Path, tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EYAS_DEVICE": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "tests.stage_process", stage, json.dumps(spec), str(output),
                             str(tmp / "work"), str(tmp)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"{output.name}-{stage}.log", "ab"))


def announced(features: Path, proc: subprocess.Popen) -> None:
    """Wait for the extractor's announcement: the orchestration starts the train job then (StageContext.hand_off)."""
    while not (features / STREAM).exists():
        assert proc.poll() is None, "the extractor ended before it announced its stream"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, what: str, timeout: float = 600) -> None:
    assert proc.wait(timeout=timeout) == 0, f"{what} failed (see its log)"


def kill_when(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """kill -9 `proc` as soon as `ready()`; fails if it ended first."""
    end = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the process ended before it could be killed mid-stream"
        assert time.monotonic() < end
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


class StoreWatch:
    """The feature bytes the stream's output directory holds, sampled every 20 ms (every object under epoch-*/,
    published or not)."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            held = 0
            for path in self.root.glob("epoch-*/*"):
                try:
                    held += path.stat().st_size
                except FileNotFoundError:
                    pass
            self.peak = max(self.peak, held)
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    return write_records(tmp_path_factory.mktemp("data"), conversations(64))


# features of ~21 MiB in shards of at most ~2.1 MiB (1 MiB and one 256-token batch); a cap of a fifth of them,
# whose windows (half the cap) hold a shard
CAP_GB = 4.4 / 1024


def specs(data: str, features: Path, cap_gb: float, policy: str) -> tuple[dict, dict]:
    extract = {"data": data, "batch_tokens": 256, "shard_mb": 1,
               "stream": {"policy": policy, "epochs": 2, "seed": 5, "max_store_gb": cap_gb}}
    train = {"features": str(features), "ttt_steps": 2, "draft_vocab_size": 256, "batch_tokens": 256, "epochs": 2,
             "lr": 1e-3, "warmup": 2, "val_every": 4, "checkpoint_every": 1000, "cache_gb": cap_gb, "seed": 1}
    return extract, train


def history(drafter: Path) -> dict:
    return json.loads((drafter / "history.json").read_text())


def test_recompute_holds_the_cap_and_survives_kill_9_of_either_side(dataset, tmp_path):
    cap_gb = CAP_GB
    cap = int(cap_gb * (1 << 30))

    # the reference: both sides run to the end
    features, drafter = tmp_path / "features", tmp_path / "drafter"
    extract, train = specs(dataset, features, cap_gb, "recompute")
    watch = StoreWatch(features)
    ext = start("extract", extract, features, tmp_path)
    announced(features, ext)
    trn = start("train", train, drafter, tmp_path)
    finish(trn, "trainer")
    finish(ext, "extractor")
    peak = watch.stop()
    plan = read_plan(open_artifact(str(features)))
    biggest = max(s.bytes for s in plan.shards)
    total = sum(s.bytes for s in plan.shards)
    assert total > 4 * cap, "the features must be more than 4× the cap"
    assert 0 < peak <= cap + biggest  # two windows of half the cap, plus the shard being written
    assert not list(features.glob("epoch-*/*.safetensors")), "every window is deleted once trained on"
    assert (features / FINISHED).exists() and read_manifest(open_artifact(str(features))).extra["policy"][
        "features"] == "recompute"
    ref = history(drafter)
    train_ids = sorted({i for e in ref["train"] for i in e["samples"]})
    for epoch in (0, 1):  # each epoch trains on every train sample once
        seen = [i for e in ref["train"] if e["epoch"] == epoch for i in e["samples"]]
        assert sorted(seen) == train_ids
    assert len(list((features / CONSUMED).iterdir())) == 2 * len(plan.windows(0))

    # the same run, the trainer and then the extractor killed with SIGKILL mid-stream and started again
    features2, drafter2 = tmp_path / "features2", tmp_path / "drafter2"
    extract, train = specs(dataset, features2, cap_gb, "recompute")
    train["features"] = str(features2)
    ext = start("extract", extract, features2, tmp_path)
    announced(features2, ext)
    trn = start("train", train, drafter2, tmp_path)
    kill_when(trn, lambda: (read_latest(open_artifact(str(drafter2))) or {"step": 0})["step"] >= 6)
    trn = start("train", train, drafter2, tmp_path)
    consumed = lambda: len(list((features2 / CONSUMED).iterdir())) if (features2 / CONSUMED).exists() else 0  # noqa: E731
    kill_when(ext, lambda: consumed() >= len(plan.windows(0)) + 2)  # inside the second epoch
    ext = start("extract", extract, features2, tmp_path)
    finish(trn, "resumed trainer")
    finish(ext, "resumed extractor")
    again = history(drafter2)
    assert [e["samples"] for e in again["train"]] == [e["samples"] for e in ref["train"]]
    assert [e["loss"] for e in again["train"]] == [e["loss"] for e in ref["train"]]
    a, b = (load_file(str(drafter / "eagle" / "model.safetensors")),
            load_file(str(drafter2 / "eagle" / "model.safetensors")))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_first_epoch_trains_as_shards_land_and_keeps_them_for_later_epochs(dataset, tmp_path):
    features, drafter = tmp_path / "features", tmp_path / "drafter"
    cache_gb = CAP_GB  # the trainer's local cache: a fifth of the features
    extract, train = specs(dataset, features, cache_gb, "first_epoch")
    ext = start("extract", extract, features, tmp_path)
    announced(features, ext)
    trn = start("train", train, drafter, tmp_path)
    finish(trn, "trainer")
    finish(ext, "extractor")
    manifest = read_manifest(open_artifact(str(features)), kind="features")
    plan = read_plan(open_artifact(str(features)))
    assert sorted(n for n in manifest.files if n.startswith("shard-")) == [s.name for s in plan.shards]
    h = history(drafter)
    train_ids = sorted({i for e in h["train"] for i in e["samples"]})
    for epoch in (0, 1):
        assert sorted(i for e in h["train"] if e["epoch"] == epoch for i in e["samples"]) == train_ids
    assert json.loads((drafter / "manifest.json").read_text())["metrics"]["feature_windows"] > 1


def test_an_extract_job_with_a_stream_starts_its_train_job_beside_it(dataset, tmp_path):
    """Embedded (`eyas extract` with `then: train`): the train job starts once the stream is announced, runs beside
    the extract job, and both succeed; the features keep nothing but the index and the announcement."""
    from eyas.settings import Settings
    from orchestration.embedded import EmbeddedRunner

    extract, train = specs(dataset, tmp_path / "unused", CAP_GB, "recompute")
    del train["features"]
    jobs = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path, Path(dataset)])).run_job(
        "extract", {**extract, "then": [{"stage": "train", **train}]})
    assert [(j.stage, j.state) for j in jobs] == [("extract", "succeeded"), ("train", "succeeded")]
    ext, trn = jobs
    assert trn.created_at < ext.updated_at, "the train job was submitted while the extract job ran"
    features = open_artifact(ext.artifacts["output"])
    assert not [n for n in features.names() if n.startswith("epoch-")]
    assert json.loads(open_artifact(trn.artifacts["output"]).get_bytes("manifest.json"))["counts"]["steps"] > 0


def test_two_extract_workers_feed_one_trainer_across_services_caching_the_first_epoch(service_settings, api_process,
                                                                                     worker_process, tmp_path):
    """Service mode (Redis, S3): an extract job with `then: train` streaming first_epoch, the trainer's cache a
    fifth of the features. Two extract workers share the stream's shards (the job's own run and a helper that took
    its task from the stage's queue), a train worker trains as they land: every shard is extracted once, and
    every train sample is trained once per epoch."""
    import httpx

    from orchestration.jobs import RedisJobStore
    from tests.conftest import wait_for_job

    data = write_records(tmp_path / "data", conversations(64))
    api = api_process("extract", service_settings)
    extractors = [worker_process("extract", service_settings) for _ in range(2)]
    trainer = worker_process("train", service_settings)
    extract, train = specs(data, tmp_path / "unused", CAP_GB, "first_epoch")
    del train["features"]
    client = httpx.Client(base_url=api.url, timeout=30)
    r = client.post("/v1/jobs", json={**extract, "max_workers": 2, "then": [{"stage": "train", **train}]})
    assert r.status_code == 202, r.text

    jobs = RedisJobStore(service_settings.settings.redis_url)  # the train job is the train service's: read it here

    def ended(job_id: str, what: str) -> dict:
        return wait_for_job(lambda: jobs.get(job_id).model_dump(),
                            lambda j: j["state"] not in ("queued", "running"), timeout=600, what=what)

    ext = ended(r.json()["id"], "extract job")
    logs = "".join(w.tail(1 << 20) for w in extractors)
    assert ext["state"] == "succeeded", (ext, logs[-3000:])
    trn = ended(ext["next_job"], "train job")
    assert trn["state"] == "succeeded", (trn, trainer.tail())
    assert trn["created_at"] < ext["updated_at"], "the train job started while the shards were extracted"
    # exactly once across both workers: the target's forwards covered the samples' tokens once
    assert ext["metrics"]["forward_tokens"] == ext["metrics"]["tokens"]
    features = open_artifact(ext["artifacts"]["output"], service_settings.settings)
    manifest = read_manifest(features, kind="features")
    assert sorted(n for n in manifest.files if n.startswith("shard-")) == [s.name for s in read_plan(features).shards]
    helped = [int(n) for n in re.findall(r"helped job \S+: (\d+) tokens extracted", logs)]
    print(f"extract tokens {ext['metrics']['tokens']}, of which the helper extracted {sum(helped)}")
    h = json.loads(open_artifact(trn["artifacts"]["output"], service_settings.settings).get_bytes("history.json"))
    train_ids = sorted({i for e in h["train"] for i in e["samples"]})
    for epoch in (0, 1):
        assert sorted(i for e in h["train"] if e["epoch"] == epoch for i in e["samples"]) == train_ids

"""The S3 server goes away for 10 s in the middle of writing an artifact: the writes are retried until it is back,
and the artifact ends complete and verified — no partial object, no half-committed artifact. The server is a
private SeaweedFS, stopped (process killed) and started again on the same address with the same data."""
from __future__ import annotations

import os
import threading
import time

import pytest

from eyas.manifest import ArtifactWriter, IncompleteArtifact, Manifest, fetch_verified, read_manifest
from eyas.settings import Settings
from eyas.store import Artifact, S3Store
from tests.servers import S3_ACCESS, S3_SECRET, WeedServer

OUTAGE_S = 10.0


@pytest.fixture
def weed():
    server = WeedServer()
    server.start()
    yield server
    server.remove()


def test_writes_ride_out_a_ten_second_outage(weed, tmp_path):
    settings = Settings(mode="service", s3_endpoint=weed.endpoint, s3_access_key=S3_ACCESS, s3_secret_key=S3_SECRET,
                        s3_bucket="outage", s3_retry_s=60)
    store = S3Store(settings)
    store.ensure_bucket()
    art = Artifact(store, "datasets/outage")
    files = {f"shard-{i}.bin": os.urandom(3 << 20) for i in range(4)}  # 3 MiB each
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    first_written, server_down = threading.Event(), threading.Event()
    outcome: dict = {}

    def write() -> None:
        try:
            writer = ArtifactWriter(art)
            names = iter(files)
            writer.put_file(next(names), tmp_path / "shard-0.bin")
            first_written.set()
            server_down.wait(30)
            started = time.monotonic()
            for name in names:  # the server is down now: these are retried until it is back
                writer.put_file(name, tmp_path / name)
            outcome["manifest"] = writer.commit(Manifest(kind="dataset", id="outage", counts={"shards": 4}))
            outcome["blocked_s"] = time.monotonic() - started
        except BaseException as e:  # the test reports it
            outcome["error"] = e

    thread = threading.Thread(target=write)
    thread.start()
    assert first_written.wait(60)
    weed.stop()
    server_down.set()
    time.sleep(OUTAGE_S)
    # while the server is away nothing is committed (and nobody could read a partial artifact)
    assert thread.is_alive() and "manifest" not in outcome
    weed.start()
    thread.join(120)
    assert not thread.is_alive() and "error" not in outcome, outcome.get("error")
    print(f"\nS3 down {OUTAGE_S:.0f} s: the write waited {outcome['blocked_s']:.1f} s, "
          f"{store.retries} retries")
    assert outcome["blocked_s"] >= OUTAGE_S - 1
    assert store.retries > 0

    manifest = read_manifest(art, kind="dataset")
    assert set(manifest.files) == set(files)
    for name, data in files.items():  # every object whole: the manifest's hashes verify
        assert fetch_verified(art, manifest, name, tmp_path / f"back-{name}").read_bytes() == data


def test_an_outage_longer_than_the_retry_window_fails_the_write_and_commits_nothing(weed, tmp_path):
    settings = Settings(mode="service", s3_endpoint=weed.endpoint, s3_access_key=S3_ACCESS, s3_secret_key=S3_SECRET,
                        s3_bucket="outage", s3_retry_s=3)
    store = S3Store(settings)
    store.ensure_bucket()
    art = Artifact(store, "datasets/gone")
    writer = ArtifactWriter(art)
    writer.put_bytes("one.bin", b"1")
    weed.stop()
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        writer.put_bytes("two.bin", b"2")
    assert 2.5 <= time.monotonic() - t0 < 30, err.value
    weed.start()
    with pytest.raises(IncompleteArtifact):  # never committed: readers refuse it
        read_manifest(art)

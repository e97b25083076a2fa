"""The object-store contract, held by both backends: the local directory (embedded) and S3 (a real SeaweedFS)."""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from eyas.keys import BadKey
from eyas.manifest import ArtifactWriter, IncompleteArtifact, Manifest, fetch_verified, read_manifest
from eyas.store import Artifact, LocalStore, S3Store, open_artifact


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    service = request.getfixturevalue("service_settings")
    return S3Store(service.settings)


def test_round_trip_list_and_delete(store, tmp_path: Path):
    store.put_bytes("a/b/one.bin", b"1")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3000))
    store.put_file("a/two.bin", src)
    store.put_bytes("ab/other.bin", b"x")  # shares the prefix's first letters, not the prefix
    assert store.get_bytes("a/b/one.bin") == b"1"
    store.get_file("a/two.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert store.exists("a/two.bin") and not store.exists("a/missing.bin")
    assert store.list("a") == ["a/b/one.bin", "a/two.bin"]
    assert store.list("a/b") == ["a/b/one.bin"]
    assert store.list("nothing") == []
    store.delete_prefix("a")
    assert store.list("a") == [] and store.list("ab") == ["ab/other.bin"]


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/etc/passwd", "a\\b", "a//b", "./a", "a/./b",
                                 "a b", ""])
def test_keys_that_could_escape_are_refused(store, key: str, tmp_path: Path):
    (tmp_path / "f").write_bytes(b"x")
    for op in (lambda: store.put_bytes(key, b"x"), lambda: store.get_bytes(key), lambda: store.exists(key),
               lambda: store.put_file(key, tmp_path / "f")):
        with pytest.raises(BadKey):
            op()
    if key:  # the empty prefix means "everything" for list
        with pytest.raises(BadKey):
            store.list(key)
    assert store.list("") == []
    if isinstance(store, LocalStore):
        assert not any(tmp_path.rglob("passwd")) and not (tmp_path / "escape").exists()


def test_readers_never_see_a_partial_object(store):
    """While a large object is being written, a reader sees the old object or the new one, whole."""
    old, new = b"o" * (6 << 20), os.urandom(12 << 20)  # the new one is big enough for a multipart upload
    store.put_bytes("big/obj.bin", old)
    seen: set[str] = set()
    done, reading = threading.Event(), threading.Event()

    def reader():
        while not done.is_set():
            data = store.get_bytes("big/obj.bin")
            seen.add("old" if data == old else "new" if data == new else f"partial:{len(data)}")
            reading.set()

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert reading.wait(30)
        store.put_bytes("big/obj.bin", new)
    finally:
        done.set()
        t.join()
    assert store.get_bytes("big/obj.bin") == new
    assert {s for s in seen if s.startswith("partial")} == set(), seen
    assert store.list("big") == ["big/obj.bin"]  # no temporary upload parts visible


def test_manifest_checksums_and_commit_marker(store, tmp_path: Path):
    art = Artifact(store, "datasets/job-1")
    writer = ArtifactWriter(art)
    shard = tmp_path / "shard.jsonl"
    shard.write_text('{"a": 1}\n' * 100)
    writer.put_file("conversations-00000.jsonl", shard)
    writer.put_bytes("notes.txt", b"hello")
    with pytest.raises(IncompleteArtifact):  # files without a manifest: not committed, refused
        read_manifest(art)
    writer.commit(Manifest(kind="dataset", id="job-1", counts={"conversations": 100}))

    m = read_manifest(art, kind="dataset")
    assert m.files["conversations-00000.jsonl"].sha256 == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert m.files["notes.txt"].sha256 == hashlib.sha256(b"hello").hexdigest()
    assert m.files["notes.txt"].bytes == 5 and m.counts == {"conversations": 100}
    assert sorted(art.names()) == ["conversations-00000.jsonl", "manifest.json", "notes.txt"]
    assert fetch_verified(art, m, "notes.txt", tmp_path / "n").read_bytes() == b"hello"
    with pytest.raises(IncompleteArtifact):
        read_manifest(art, kind="features")

    art.put_bytes("notes.txt", b"hellO")  # altered after the commit
    with pytest.raises(IncompleteArtifact, match="sha256"):
        fetch_verified(art, m, "notes.txt", tmp_path / "n2")
    with pytest.raises(IncompleteArtifact, match="not listed"):
        fetch_verified(art, m, "extra.bin", tmp_path / "n3")


def test_artifacts_open_by_uri(store, request):
    art = Artifact(store, "features/job-2")
    art.put_bytes("x.bin", b"42")
    settings = request.getfixturevalue("service_settings").settings if isinstance(store, S3Store) else None
    again = open_artifact(art.uri, settings)
    assert again.uri == art.uri and again.get_bytes("x.bin") == b"42" and again.names() == ["x.bin"]


def test_s3_artifacts_open_only_with_settings():
    # S3 credentials come from the caller (a stage's context), never from a process-wide default
    with pytest.raises(ValueError, match="s3://bucket/features/x: opening an s3:// artifact needs the S3 settings"):
        open_artifact("s3://bucket/features/x")

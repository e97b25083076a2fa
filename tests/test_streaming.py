"""Features read as a stream through a bounded cache (eyas.streaming, services.trainer.data): windows of shards that
fit half the cache, shuffled per epoch; a local copy that never holds more than two windows; every train sample once
per epoch in a deterministic order; and training through a small cache that resumes exactly where it stopped."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from eyas.features import FeatureReader, Index, Sample, ShardBuffer, is_validation, shard_name
from eyas.handoff import INDEX
from eyas.layout import Layout
from eyas.manifest import ArtifactWriter, Manifest, read_manifest
from eyas.settings import Settings
from eyas.stage import StageContext
from eyas.store import Artifact, LocalStore, open_artifact
from eyas.streaming import FeatureStream, WindowCache
from eyas.target import BUNDLED, config_hash, load_tokenizer, resolve_target, tokenizer_hash
from eyas.windows import shard_windows
from services.trainer import core
from services.trainer.data import BatchStream, DataPosition, plan_features
from services.trainer.spec import Spec

HIDDEN, VOCAB = 576, 49152  # the bundled target's: the trainer loads its real head
LAYOUT = Layout(target=BUNDLED, target_config_hash="-", tokenizer_hash="-", num_layers=30, hidden_size=HIDDEN,
                vocab_size=VOCAB, aux_layers=(1, 14, 26))


def write_features(dest: Path, samples: int, per_shard: int, seed: int = 0) -> str:
    """Synthetic features of the bundled target's shapes: `samples` samples of 24–40 tokens, `per_shard` a shard."""
    layout = Layout.from_dict({**LAYOUT.to_dict(), "target_config_hash": config_hash(resolve_target(BUNDLED)),
                               "tokenizer_hash": tokenizer_hash(load_tokenizer(BUNDLED))})  # as the trainer checks
    writer, buf, g = ArtifactWriter(open_artifact(str(dest))), ShardBuffer(max_bytes=1 << 40), torch.Generator()
    g.manual_seed(seed)
    tokens: list[list[tuple]] = []  # each shard's samples' (input_ids, loss_mask): the index
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(samples):
            T = 24 + int(torch.randint(0, 17, (1,), generator=g))
            mask = torch.ones(T, dtype=torch.long)
            mask[:8] = 0
            buf.add(Sample(torch.randint(0, 4096, (T,), generator=g), mask,
                           torch.randn(T, 3 * HIDDEN, generator=g).bfloat16(),
                           torch.randn(T, HIDDEN, generator=g).bfloat16()))
            if len(buf.samples) == per_shard or i == samples - 1:
                tokens.append([(s.input_ids, s.loss_mask) for s in buf.samples])
                path = Path(tmp) / shard_name(i // per_shard)
                buf.write(path)
                writer.put_file(path.name, path)
    writer.put_bytes(INDEX, Index.of(tokens).to_bytes())
    writer.commit(Manifest(kind="features", id=dest.name, layout=layout.to_dict(), counts={"samples": samples}))
    return str(dest)


def test_windows_fit_half_the_cache_cover_every_shard_once_and_shuffle_per_epoch():
    sizes = {shard_name(i): 10 + i for i in range(12)}
    assert shard_windows(sizes, cache_bytes=2 * sum(sizes.values()), seed=3, epoch=5) == [list(sizes)]
    for epoch in range(3):
        windows = shard_windows(sizes, cache_bytes=70, seed=3, epoch=epoch)
        assert sorted(sum(windows, [])) == sorted(sizes) and len(windows) > 3
        assert all(sum(sizes[n] for n in w) <= 35 for w in windows)
        assert windows == shard_windows(sizes, cache_bytes=70, seed=3, epoch=epoch)  # a pure function
    assert shard_windows(sizes, 70, 3, 0) != shard_windows(sizes, 70, 3, 1)
    assert sum(shard_windows(sizes, 70, None), []) == list(sizes)  # seed None: artifact order
    assert shard_windows({"big": 100, "small": 1}, cache_bytes=20, seed=None) == [["big"], ["small"]]


def test_the_local_copy_never_holds_more_than_two_windows(tmp_path):
    sizes = {f"s{i}": 1000 for i in range(16)}
    windows = shard_windows(sizes, cache_bytes=4000, seed=1, epoch=0)  # two shards a window
    cache_dir, peak = tmp_path / "cache", []

    def fetch(name: str, path: Path) -> None:
        path.write_bytes(b"x" * sizes[name])
        peak.append(sum(p.stat().st_size for p in cache_dir.iterdir()))

    cache = WindowCache(fetch, cache_dir)
    for w, window in enumerate(windows):
        local = cache.enter(window, windows[w + 1] if w + 1 < len(windows) else [])
        assert sorted(local) == sorted(window) and all(p.exists() for p in local.values())
    cache.close()
    assert max(peak) <= 4000 and cache.fetched == 16


def test_an_epoch_through_a_small_cache_trains_on_every_sample_once_in_a_resumable_order(tmp_path):
    uri = write_features(tmp_path / "features", samples=60, per_shard=5)
    reader = FeatureReader(open_artifact(uri), cache_dir=tmp_path / "cache")
    shard = max(reader.sizes.values())
    stream = FeatureStream(reader, cache_bytes=4 * shard)  # one or two of the twelve shards a window
    data = plan_features(stream, val_every=10, vocab_size=VOCAB)
    assert not stream.whole and 6 <= len(stream.windows(0, 0)) < 12
    assert data.train == [i for i in range(60) if not is_validation(i, 10)] and len(data.val_indices) == 6
    windows = data.windows(seed=0)
    batches = BatchStream(data.lengths, 256, seed=0, windows=windows, pack=True)
    every = list(FeatureReader(open_artifact(uri)).samples())  # artifact order, read plainly
    # the index plans what a scan of the features would: lengths and the train samples' supervised ids
    assert data.lengths == [every[i].input_ids.numel() for i in data.train]
    assert torch.equal(data.counts, sum(torch.bincount(every[i].input_ids[every[i].loss_mask.bool()], minlength=VOCAB)
                                        for i in data.train))
    # validation keeps the samples of epoch 0's first window that fit a quarter of the cache, copied out
    val = data.load_validation(seed=0)
    first = set(stream.windows(0, 0)[0])
    held = [i for i in data.val_indices if stream.shard_of(i) in first]
    assert 1 <= len(val) <= len(held) and all(torch.equal(v.aux_hidden, every[i].aux_hidden)
                                              for v, i in zip(val, held, strict=False))
    seen, order, peak = [], [], 0
    while len(seen) < len(data.train):
        batch = batches.next()
        data.enter(0, *batches.window)
        peak = max(peak, sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()))
        positions = [p for row in batch for p in row]
        for position in positions:  # read from the loaded window: the sample the artifact holds at that index
            assert torch.equal(data.sample(position).aux_hidden, every[data.train[position]].aux_hidden)
        seen += positions
        order.append(batch)
    assert sorted(seen) == list(range(len(data.train)))  # every train sample once
    assert peak <= 4 * shard
    resumed = BatchStream(data.lengths, 256, seed=0, position=DataPosition(0, 3), windows=windows, pack=True)
    assert [resumed.next() for _ in range(len(order) - 3)] == order[3:]
    stream.close()


def test_training_through_a_small_cache_resumes_exactly(tmp_path):
    emb_settings = Settings(workdir=tmp_path / "work", input_roots=[tmp_path])
    uri = write_features(tmp_path / "features", samples=40, per_shard=4)
    shard_gb = FeatureReader(open_artifact(uri)).manifest.files[shard_name(0)].bytes / (1 << 30)
    store = LocalStore(emb_settings.store_root)
    spec = {"features": uri, "ttt_steps": 2, "draft_vocab_size": 256, "batch_tokens": 256, "steps": 12, "lr": 1e-3,
            "warmup": 2, "val_every": 10, "checkpoint_every": 4, "cache_gb": 4 * shard_gb}

    def run(name: str, crash_at: int | None = None) -> dict:
        class Crash(RuntimeError):
            pass

        def report(done, total, unit, metrics):
            if done == crash_at:
                raise Crash(f"died at step {done}")
            return False

        ctx = StageContext(job_id=name, settings=emb_settings, store=store,
                           output=Artifact(store, f"drafters/{name}"), report=report)
        try:
            core.run(Spec.model_validate(spec), ctx)
        except Crash:
            ctx.report = lambda *a: False
            core.run(Spec.model_validate(spec), ctx)
        assert read_manifest(ctx.output, kind="drafter").metrics["feature_windows"] > 1
        return json.loads(ctx.output.get_bytes("history.json"))

    whole = run("whole")
    again = run("crashed", crash_at=6)
    assert [e["loss"] for e in again["train"]] == pytest.approx([e["loss"] for e in whole["train"]], rel=1e-5)


@pytest.mark.parametrize("shards_held", [0.5, 1.5])
def test_a_cache_that_cannot_hold_two_shards_is_refused_up_front(tmp_path, shards_held):
    """The cache is a bound whatever the shard size: one smaller than two shards (the window read and the next)
    refuses the train job before it trains, naming cache_gb, the shard and what to change."""
    settings = Settings(workdir=tmp_path / "work", input_roots=[tmp_path])
    uri = write_features(tmp_path / "features", samples=8, per_shard=4)
    largest = max(FeatureReader(open_artifact(uri)).sizes.values())
    store = LocalStore(settings.store_root)
    ctx = StageContext(job_id="small", settings=settings, store=store, output=Artifact(store, "drafters/small"),
                       report=lambda *a: False)
    spec = Spec.model_validate({"features": uri, "ttt_steps": 2, "draft_vocab_size": 256, "steps": 2,
                                "cache_gb": shards_held * largest / (1 << 30)})
    with pytest.raises(ValueError, match=rf"cache_gb=\S+ cannot hold the features' shard \S+ "
                       rf"\({largest / (1 << 20):.1f} "
                       r"MiB\) twice over .*raise cache_gb to at least \S+, or lower the extract job's shard_mb"):
        core.run(spec, ctx)
    assert not ctx.output.names()  # nothing written

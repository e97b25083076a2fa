"""Streamed features: the trainer's data path through a bounded cache (eyas.streaming) against reading the whole
artifact (every shard copied to local disk first, as the trainer did before `cache_gb`), on synthetic features of
the bundled target's shapes at 1×, 4× and 16× the cache, each run in a fresh process.

What it reports, per size: peak local disk (the cache directory, sampled every 10 ms and at every window change)
over the cap, peak resident memory, shards fetched, and the wall time of one epoch of reading (every train sample
touched once, in the trainer's windowed order) beside the copy-everything reader on the same features.

    .venv/bin/python bench/streaming.py [--cache-mib 64] [--sizes 1,4,16] [--hidden 576]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the synthetic features writer of bench/features_memory.py

from bench.features_memory import write_features  # noqa: E402
from eyas.features import FeatureReader  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from eyas.streaming import FeatureStream  # noqa: E402
from services.trainer.data import BatchStream, plan_features  # noqa: E402

VAL_EVERY = 10


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.exists() else 0


class DiskPeak:
    """The largest size the directory reached, sampled in a thread (and whenever `look` is called)."""

    def __init__(self, path: Path):
        self.path, self.peak, self._stop = path, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def look(self) -> None:
        try:
            self.peak = max(self.peak, _dir_bytes(self.path))
        except FileNotFoundError:  # a shard deleted while listed
            pass

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.look()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.look()
        return self.peak


def child(mode: str, features: Path, cache_bytes: int) -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eyas-cache-") as tmp:
        cache_dir = Path(tmp)
        disk = DiskPeak(cache_dir)
        reader = FeatureReader(open_artifact(str(features)), cache_dir=cache_dir)
        touched = 0.0
        if mode == "whole":  # every shard local and in memory at once
            loaded = [reader.load_shard(name) for name in reader.shards]
            disk.look()
            touched = sum(float(t["aux_hidden"].float().sum()) for t in loaded)
            fetched = len(reader.shards)
        else:
            stream = FeatureStream(reader, cache_bytes)
            data = plan_features(stream, VAL_EVERY, 49152)
            batches = BatchStream(data.lengths, 4096, seed=0, windows=data.windows(0))
            per_epoch = batches.batches_per_epoch()
            for _ in range(per_epoch):  # one epoch, as the trainer walks it
                batch = batches.next()
                data.enter(0, *batches.window)
                disk.look()
                touched += sum(float(data.sample(p).aux_hidden.float().sum()) for row in batch for p in row)
            stream.close()
            fetched = stream.cache.fetched
        peak = disk.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_disk": peak, "peak_rss": rss, "fetched": fetched, "seconds": time.perf_counter() - t0,
                      "checksum": touched}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-mib", type=float, default=64.0, help="the cache cap (default: %(default)s MiB)")
    p.add_argument("--sizes", default="1,4,16", help="features sizes in multiples of the cap (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size (default: the bundled target's)")
    p.add_argument("--child", choices=["stream", "whole"], help=argparse.SUPPRESS)
    p.add_argument("--features", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--cache-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.features, args.cache_bytes)
        return
    cap = int(args.cache_mib * (1 << 20))
    rows = []
    for k in (float(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="eyas-bench-") as tmp:
            features = Path(tmp) / "features"
            samples, shards = write_features(features, k * cap / (1 << 30), args.hidden, shard_bytes=cap // 16)
            size = sum(f.stat().st_size for f in features.glob("shard-*"))
            shard = max(f.stat().st_size for f in features.glob("shard-*"))
            got = {mode: json.loads(subprocess.run(
                [sys.executable, __file__, "--child", mode, "--features", str(features), "--cache-bytes", str(cap)],
                check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
                for mode in ("stream", "whole")}
        rows.append((k, size, shard, shards, got))
    print(f"cache cap {cap / (1 << 20):.0f} MiB; hidden {args.hidden}; peak disk and memory of one epoch's reading")
    print(f"{'features':>10} {'shards':>6} | {'stream: disk/cap':>16} {'≤ cap+shard':>11} {'RSS MiB':>8} "
          f"{'fetched':>7} {'s':>6} | {'whole: disk/cap':>15} {'RSS MiB':>8} {'s':>6}")
    for k, size, shard, shards, got in rows:
        s, w = got["stream"], got["whole"]
        print(f"{k:>3.0f}×{size / (1 << 20):>5.0f}MiB {shards:>6} | {s['peak_disk'] / cap:>16.2f} "
              f"{str(s['peak_disk'] <= cap + shard):>11} "
              f"{s['peak_rss'] / (1 << 20):>8.0f} {s['fetched']:>7} {s['seconds']:>6.1f} | "
              f"{w['peak_disk'] / cap:>15.2f} {w['peak_rss'] / (1 << 20):>8.0f} {w['seconds']:>6.1f}")
    rss = [r[4]["stream"]["peak_rss"] for r in rows]
    print(f"stream peak RSS, largest over smallest features: {max(rss) / min(rss):.2f} "
          f"(features {rows[-1][0] / rows[0][0]:.0f}× larger)")


if __name__ == "__main__":
    main()

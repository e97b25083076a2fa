"""Extraction and training together (eyas.handoff) against one after the other, on the bundled target: the same
conversations, extract → train with the trainer's CPU preset, each variant in a fresh process.

Variants: `cache` (extract everything, then train: the plain pipeline), `first_epoch` (train on the shards as they
land, keep them for later epochs) and `recompute` (extract every epoch again, at most `--cap-mib` stored). Printed
per variant: wall time, each job's time, target forwards (tokens extracted), the peak of feature bytes stored, the
final validation loss / accuracy, and the capture vs training throughput; then the object-store hop of one shard
(put + get, local directory store) against one training step.

    .venv/bin/python bench/handoff.py [--conversations 240] [--epochs 2] [--cap-mib 24] [--shard-mb 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ("the river carries light stones past quiet farms while herons wait in reeds and a slow boat drifts toward "
         "the old mill where children count fish under a pale sky as bells ring across wet fields of barley").split()


def write_dataset(directory: Path, n: int) -> str:
    """`n` single-turn conversations of 60–180 answer words, in the generator's artifact format."""
    from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest
    from eyas.store import Artifact, LocalStore
    from eyas.target import BUNDLED, load_tokenizer, tokenizer_hash

    records = []
    for i in range(n):
        answer = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60 + (i * 37) % 120))
        records.append({"id": f"b{i}", "messages": [{"role": "user", "content": f"Tell me story {i}, please."},
                                                    {"role": "assistant", "content": answer}]})
    directory.mkdir(parents=True, exist_ok=True)
    writer = ArtifactWriter(Artifact(LocalStore(directory)))
    writer.put_bytes("conversations-00000.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    writer.commit(Manifest(kind="dataset", id="bench", counts={"conversations": n},
                           dataset=DatasetFacts(target=BUNDLED,
                                                tokenizer_hash=tokenizer_hash(load_tokenizer(BUNDLED)))))
    return str(directory)


class StoredPeak:
    """The most feature bytes (shards, of any epoch) the store directory held, sampled every 20 ms."""

    def __init__(self, root: Path):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            held = 0
            for path in self.root.glob("features/*/**/shard-*.safetensors"):
                try:
                    held += path.stat().st_size
                except FileNotFoundError:
                    pass
            self.peak = max(self.peak, held)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def child(variant: str, data: str, workdir: Path, epochs: int, cap_mib: float, shard_mb: int) -> None:
    from eyas.settings import Settings
    from eyas.store import open_artifact
    from orchestration.embedded import EmbeddedRunner
    from services.trainer.spec import CPU_PRESET

    cap_gb = cap_mib / 1024
    settings = Settings(workdir=workdir, input_roots=[Path(data)])
    train = {"stage": "train", **CPU_PRESET, "epochs": float(epochs), "val_interval": 0, "cache_gb": max(cap_gb, 1)}
    extract = {"data": data, "shard_mb": shard_mb, "batch_tokens": 1024}  # shards of a few batches: windows of several
    if variant != "cache":
        extract["stream"] = {"policy": variant, "epochs": epochs, "max_store_gb": cap_gb}
    peak = StoredPeak(settings.store_root)
    t0 = time.monotonic()
    jobs = EmbeddedRunner(settings).run_job("extract", {**extract, "then": [train]})
    wall = time.monotonic() - t0
    stored = peak.stop()
    ext, trn = jobs
    assert ext.state == trn.state == "succeeded", [(j.stage, j.state, j.error) for j in jobs]
    features = json.loads(open_artifact(ext.artifacts["output"]).get_bytes("manifest.json"))
    drafter = json.loads(open_artifact(trn.artifacts["output"]).get_bytes("manifest.json"))
    print(json.dumps({
        "variant": variant, "wall_s": wall,
        "extract_s": ext.updated_at - ext.created_at, "train_s": trn.updated_at - trn.created_at,
        "train_started_after_s": trn.created_at - ext.created_at,
        "tokens": features["counts"]["tokens"], "forward_tokens": features["metrics"]["forward_tokens"],
        "stored_peak": stored, "steps": drafter["counts"]["steps"],
        "train_tok_s": drafter["metrics"]["tokens_per_s"],
        "step_s": (trn.updated_at - trn.created_at) / drafter["counts"]["steps"],  # alone: with no wait in it
        "val_loss": drafter["metrics"].get("val_loss"), "val_acc0": (drafter["metrics"].get("val_acc") or [None])[0],
    }))


def store_hop(workdir: Path) -> dict:
    """One 256 MiB-class shard's trip through a local directory store: put then get (the hand-off's hop)."""
    import os

    from eyas.store import LocalStore

    store, src = LocalStore(workdir / "hop"), workdir / "shard.bin"
    src.write_bytes(os.urandom(64 << 20))
    t0 = time.perf_counter()
    store.put_file("features/x/shard-00000.safetensors", src)
    t1 = time.perf_counter()
    store.get_file("features/x/shard-00000.safetensors", workdir / "back.bin")
    t2 = time.perf_counter()
    return {"mib": 64, "put_s": t1 - t0, "get_s": t2 - t1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=240)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cap-mib", type=float, default=24.0, help="recompute/first_epoch: max_store_gb, in MiB")
    p.add_argument("--shard-mb", type=int, default=4, help="extract shard_mb: windows hold whole shards")
    p.add_argument("--variants", default="cache,first_epoch,recompute")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.data, args.workdir, args.epochs, args.cap_mib, args.shard_mb)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="eyas-bench-handoff-") as tmp:
        data = write_dataset(Path(tmp) / "data", args.conversations)
        for variant in args.variants.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", variant, "--data", data, "--workdir",
                                  str(Path(tmp) / variant), "--epochs", str(args.epochs), "--cap-mib",
                                  str(args.cap_mib), "--shard-mb", str(args.shard_mb)],
                                 check=True, capture_output=True, text=True, cwd=REPO)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        hop = store_hop(Path(tmp))
    base = rows[0]
    print(f"{args.conversations} conversations, {base['tokens']} tokens, {args.epochs} epochs; shards of "
          f"{args.shard_mb} MiB; cap {args.cap_mib:g} MiB for the streamed variants")
    print(f"{'variant':>12} {'wall s':>7} {'× cache':>7} {'extract s':>9} {'train s':>7} {'train from':>10} "
          f"{'fwd tok':>8} {'stored MiB':>10} {'steps':>5} {'val loss':>8} {'acc0':>6}")
    for r in rows:
        print(f"{r['variant']:>12} {r['wall_s']:7.0f} {r['wall_s'] / base['wall_s']:7.2f} {r['extract_s']:9.0f} "
              f"{r['train_s']:7.0f} {r['train_started_after_s']:9.0f}s {r['forward_tokens']:8d} "
              f"{r['stored_peak'] / (1 << 20):10.1f} {r['steps']:5d} {r['val_loss'] or float('nan'):8.3f} "
              f"{r['val_acc0'] or float('nan'):6.3f}")
    capture = base["tokens"] / base["extract_s"]
    print(f"capture {capture:.0f} tok/s alone, training {base['train_tok_s']:.0f} tok/s alone "
          f"(training / capture = {base['train_tok_s'] / capture:.2f})")
    print(f"store hop of a {hop['mib']} MiB shard: put {hop['put_s']:.2f} s + get {hop['get_s']:.2f} s; one training "
          f"step {base['step_s']:.2f} s")


if __name__ == "__main__":
    main()

"""Feature memory: the private (anonymous) memory the trainer's data path keeps for a features artifact, vs the
plain alternative of reading every shard into memory (`safetensors.torch.load` of the file's bytes), side by side
on the same synthetic features, each in a fresh process.

The trainer's path is the code `train()` runs: `FeatureReader` (manifest, sha256 and NaN checks) → `FeatureStream`
with a cache the features fit (one window) → `plan_features`, then every train sample read from the loaded window.
FeatureReader opens shards with safetensors' `load_file`, which maps the file: samples are views of file-backed
pages that the kernel can drop and read again, so features larger than RAM still train (slower, from disk) instead
of the process being killed. Both paths touch every value once after loading.

    .venv/bin/python bench/features_memory.py [--gib 1.0] [--hidden 576]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from eyas.features import FeatureReader, Index, Sample, ShardBuffer, shard_name
from eyas.handoff import INDEX
from eyas.layout import AUX_HIDDEN, FINAL_HIDDEN, Layout
from eyas.manifest import ArtifactWriter, Manifest
from eyas.store import open_artifact
from eyas.streaming import FeatureStream
from services.trainer.data import plan_features

TOKENS_PER_SAMPLE = 384


def _memory_mib() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile")}


def write_features(dest: Path, gib: float, hidden: int, shard_bytes: int = 256 << 20) -> tuple[int, int]:
    """A features artifact of about `gib` GiB of random hidden states (bundled-target shapes by default), in shards
    of about `shard_bytes`."""
    layout = Layout(target="bench", target_config_hash="-", tokenizer_hash="-", num_layers=30, hidden_size=hidden,
                    vocab_size=49152, aux_layers=(1, 14, 26))
    per_token = 4 * hidden * 2  # three aux layers + the final hidden state, bf16
    samples = int(gib * (1 << 30) / (per_token * TOKENS_PER_SAMPLE))
    writer = ArtifactWriter(open_artifact(str(dest)))
    buf, shards, tokens = ShardBuffer(max_bytes=shard_bytes), 0, []
    with tempfile.TemporaryDirectory() as tmp:
        def flush():
            nonlocal shards
            tokens.append([(s.input_ids, s.loss_mask) for s in buf.samples])  # the index's
            path = Path(tmp) / shard_name(shards)
            buf.write(path)
            writer.put_file(path.name, path)
            path.unlink()
            shards += 1

        g = torch.Generator().manual_seed(0)
        for _ in range(samples):
            T = TOKENS_PER_SAMPLE
            full = buf.add(Sample(torch.randint(0, 49152, (T,), generator=g), torch.ones(T, dtype=torch.long),
                                  torch.randn(T, 3 * hidden, generator=g).bfloat16(),
                                  torch.randn(T, hidden, generator=g).bfloat16()))
            if full:
                flush()
        if buf.samples:
            flush()
    writer.put_bytes(INDEX, Index.of(tokens).to_bytes())
    writer.commit(Manifest(kind="features", id="bench", layout=layout.to_dict(),
                           counts={"samples": samples, "tokens": samples * TOKENS_PER_SAMPLE}))
    return samples, shards


def child(mode: str, features: Path) -> None:
    base = _memory_mib()
    if mode == "plain":
        from safetensors.torch import load

        held = []  # every shard's tensors in private memory, as a loader that reads the bytes would hold them
        for path in sorted(features.glob("shard-*.safetensors")):
            held.append(load(path.read_bytes()))
        for t in held:
            float(t[AUX_HIDDEN].float().sum() + t[FINAL_HIDDEN].float().sum())
        after = _memory_mib()
    else:
        with tempfile.TemporaryDirectory() as cache:
            reader = FeatureReader(open_artifact(str(features)), cache_dir=Path(cache))
            data = plan_features(FeatureStream(reader, cache_bytes=1 << 50), 10, 49152)
            val = data.load_validation(0)
            for s in [data.sample(p) for p in range(len(data.train))] + val:
                float(s.aux_hidden.float().sum() + s.final_hidden.float().sum())
            after = _memory_mib()
    print(json.dumps({k: after[k] - base[k] for k in after}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the synthetic features (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size (default: the bundled target's)")
    p.add_argument("--child", choices=["plain", "eyas"], help=argparse.SUPPRESS)
    p.add_argument("--features", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.features)
        return
    with tempfile.TemporaryDirectory(prefix="eyas-bench-") as tmp:
        features = Path(tmp) / "features"
        samples, shards = write_features(features, args.gib, args.hidden)
        size = sum(f.stat().st_size for f in features.glob("shard-*")) / (1 << 20)
        got = {mode: json.loads(subprocess.run(
            [sys.executable, __file__, "--child", mode, "--features", str(features)],
            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]) for mode in ("plain", "eyas")}
    print(f"features: {size:.0f} MiB in {shards} shards, {samples} samples")
    for mode, label in (("plain", "read into memory (safetensors.torch.load)"), ("eyas", "trainer's data path")):
        print(f"{label:<44} private {got[mode]['RssAnon']:8.0f} MiB   file-backed {got[mode]['RssFile']:8.0f} MiB")
    print(f"private memory ratio trainer/plain: {got['eyas']['RssAnon'] / got['plain']['RssAnon']:.3f}"
          f"  (private memory per features MiB: {got['eyas']['RssAnon'] / size:.3f}"
          f" vs {got['plain']['RssAnon'] / size:.3f})")


if __name__ == "__main__":
    main()

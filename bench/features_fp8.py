"""FP8 features against bf16 at fixed data (issue #45, item 1): the same extract job with features_dtype bfloat16
and float8_e4m3fn on the bundled target, then the same short train job on each; side by side:

  bytes/token     the shard files' bytes (the manifest's entries) over the tokens (goal: fp8 ≤ 0.52× bf16)
  extract tok/s   the extract job's tokens over its wall time, after an untimed warm-up job (which loads the
                  target); the jobs run bf16, fp8, fp8, bf16 and each dtype's best counts
  write tok/s     the shard writer alone (eyas.features.ShardBuffer.write: bf16 cast, or fp8 quantization) on the
                  same extracted samples: what fp8 adds to an extract on a GPU, where the forward is not the bottleneck
  train tok/s     the train job's mean tokens/s per step (shard loading and fp8 dequantization included)
  codec tok/s     quantize and dequantize alone (eyas.features), at an 8B target's shapes (--hidden 4096, 3 aux
                  layers), on this process's torch threads: the CPU work fp8 adds per token to an extract (the vLLM
                  engine hands its states to the host before the writer quantizes) and to a train step
  val loss / acc  the train job's last validation, for a sanity check only: τ is measured by the command in
                  bench/README.md (80 MT-bench prompts, three seeds each)

Conversations: the bundled MT-bench prompts, both user turns as the user's and the assistant's text (as
bench/extractor.py), so the sizes are deterministic.

    .venv/bin/python bench/features_fp8.py [--samples 24] [--steps 20]     # EYAS_DEVICE / EYAS_DTYPE apply
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from eyas.features import FeatureReader, ShardBuffer, dequantize, quantize
from eyas.layout import BF16, FP8
from eyas.manifest import ArtifactWriter, DatasetFacts, Manifest
from eyas.prompts import bundled_prompt_file, load_prompts
from eyas.settings import get_settings
from eyas.store import Artifact, LocalStore, open_artifact
from eyas.target import BUNDLED, load_tokenizer, tokenizer_hash
from orchestration.embedded import EmbeddedRunner


def write_data(directory: Path, samples: int) -> str:
    records = [{"id": p.id, "messages": [{"role": "user", "content": p.user_turns[0]},
                                         {"role": "assistant", "content": " ".join(p.user_turns)}]}
               for p in load_prompts(bundled_prompt_file("mt_bench"))[:samples]]
    directory.mkdir(parents=True)
    writer = ArtifactWriter(Artifact(LocalStore(directory)))
    writer.put_bytes("conversations-00000.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
    writer.commit(Manifest(kind="dataset", id="bench-fp8", counts={"conversations": len(records)},
                           dataset=DatasetFacts(target=BUNDLED,
                                                tokenizer_hash=tokenizer_hash(load_tokenizer(BUNDLED)))))
    return str(directory)


def write_rate(reader: FeatureReader, dtype: str, tmp: Path, repeats: int = 3) -> float:
    """Tokens/s of the shard writer alone, storing `reader`'s samples in `dtype` (best of `repeats`)."""
    samples = list(reader.samples())
    tokens = sum(len(s.input_ids) for s in samples)
    best = float("inf")
    for _ in range(repeats):
        buf = ShardBuffer(max_bytes=1 << 40, dtype=dtype)
        for s in samples:
            buf.add(s)
        t0 = time.perf_counter()
        buf.write(tmp / f"w-{dtype}.safetensors")
        best = min(best, time.perf_counter() - t0)
    return tokens / best


def codec_rates(hidden: int, n_aux: int = 3, tokens: int = 1024, repeats: int = 3) -> dict[str, float]:
    """Tokens/s of quantize and of dequantize (aux and final states of `tokens` tokens), best of `repeats`."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, n_aux * hidden, generator=g).bfloat16()
    final = torch.randn(tokens, hidden, generator=g).bfloat16()
    best = {"quantize_tok_s": float("inf"), "dequantize_tok_s": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        coded = quantize(aux, n_aux), quantize(final, 1)
        t1 = time.perf_counter()
        for q, scale in coded:
            dequantize(q, scale)
        t2 = time.perf_counter()
        best = {"quantize_tok_s": min(best["quantize_tok_s"], t1 - t0),
                "dequantize_tok_s": min(best["dequantize_tok_s"], t2 - t1)}
    return {k: tokens / v for k, v in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=24, help="MT-bench prompts as conversations (at most 80)")
    ap.add_argument("--steps", type=int, default=20, help="train steps on each")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096, help="the codec rows' hidden size")
    args = ap.parse_args()
    print(json.dumps({"codec": {"hidden": args.hidden, "threads": torch.get_num_threads(),
                                **codec_rates(args.hidden)}}), flush=True)
    with tempfile.TemporaryDirectory(prefix="eyas-bench-fp8-") as tmp:
        tmp = Path(tmp)
        data = write_data(tmp / "data", args.samples)
        base = get_settings()
        emb = EmbeddedRunner(base.model_copy(update={"workdir": tmp / "w", "input_roots": [tmp]}))
        # untimed: the first job in a process loads the target and warms its caches
        [warm] = emb.run_job("extract", {"data": write_data(tmp / "warm", 2)}, output_dir=tmp / "warm-features")
        assert warm.state == "succeeded", warm.error
        rows: dict[str, dict] = {}
        for run, dtype in enumerate((BF16, FP8, FP8, BF16)):  # ABBA, best of two per dtype: drift cancels
            out = tmp / f"{dtype}-{run}"
            t0 = time.perf_counter()
            [ext] = emb.run_job("extract", {"data": data, "features_dtype": dtype, "batch_tokens": args.batch_tokens},
                                output_dir=out)
            extract_s = time.perf_counter() - t0
            assert ext.state == "succeeded", ext.error
            reader = FeatureReader(open_artifact(str(out)))
            tokens = reader.manifest.counts["tokens"]
            [trn] = emb.run_job("train", {"features": str(out), "steps": args.steps, "ttt_steps": 3,
                                          "draft_vocab_size": 4096, "batch_tokens": args.batch_tokens, "warmup": 2,
                                          "val_every": 6, "val_interval": args.steps, "seed": 0})
            assert trn.state == "succeeded", trn.error
            m = trn.metrics
            row = {"tokens": tokens,
                   "bytes_per_token": sum(reader.manifest.files[n].bytes for n in reader.shards) / tokens,
                   "extract_tok_s": tokens / extract_s, "train_tok_s": m["tokens_per_s"],
                   "val_loss": m.get("val_loss"), "val_acc0": (m.get("val_acc") or [None])[0]}
            print(json.dumps({"dtype": dtype, "run": run, **row}), flush=True)
            if dtype in rows:
                row = {**rows[dtype], **{k: max(rows[dtype][k], row[k]) for k in ("extract_tok_s", "train_tok_s")}}
            rows[dtype] = row
        source = FeatureReader(open_artifact(str(tmp / f"{BF16}-0")))  # the same samples written each way
        for dtype in (BF16, FP8):
            rows[dtype]["write_tok_s"] = write_rate(source, dtype, tmp)
            print(json.dumps({"dtype": dtype, "best": rows[dtype]}), flush=True)
        b, f = rows[BF16], rows[FP8]
        print(json.dumps({"fp8_over_bf16": {k: f[k] / b[k] for k in ("bytes_per_token", "extract_tok_s",
                                                                      "write_tok_s", "train_tok_s")},
                          "device": base.device, "samples": args.samples, "steps": args.steps}))

if __name__ == "__main__":
    main()

"""Extractor benchmark: tokens/s of the capture forward vs a plain forward without capture, on the same batches,
run side by side (interleaved), and bytes per token of the written shards vs (3+1)·H·2.

    .venv/bin/python bench/extractor.py [--samples 48] [--repeats 3]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eyas.features import Sample, ShardBuffer
from eyas.render import render_conversation
from eyas.target import BUNDLED, load_target
from services.extractor.capture import capture
from services.extractor.core import _batches, layout_for
from services.generator.dataset import bundled_prompt_file, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    args = ap.parse_args()

    target = load_target(BUNDLED)
    layout = layout_for(target, None)
    prompts = load_prompts(bundled_prompt_file("mt_bench"))[: args.samples]
    items = []
    for p in prompts:  # MT-bench turns as stand-in conversations (both turns as user/assistant text)
        msgs = [{"role": "user", "content": p.user_turns[0]}, {"role": "assistant", "content": " ".join(p.user_turns)}]
        r = render_conversation(target.tokenizer, msgs)
        items.append((p.id, r.input_ids, r.loss_mask))
    batches = []
    for batch in _batches(items, args.batch_tokens):
        T = len(batch[0][1])
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        attn = torch.zeros(len(batch), T, dtype=torch.long)
        for b, (_, x, _) in enumerate(batch):
            ids[b, : len(x)], attn[b, : len(x)] = torch.tensor(x), 1
        batches.append((ids, attn, [len(x) for _, x, _ in batch]))
    tokens = sum(sum(n) for _, _, n in batches)

    def plain():
        with torch.inference_mode():
            for ids, attn, _ in batches:
                target.model.model(input_ids=ids, attention_mask=attn, use_cache=False)

    def captured():
        for ids, attn, _ in batches:
            capture(target, layout, ids, attn)

    plain()  # warm-up
    times = {"plain": [], "capture": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        for name, fn in (("plain", plain), ("capture", captured)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tps = {k: tokens / min(v) for k, v in times.items()}

    buf = ShardBuffer()
    for ids, attn, lens in batches:
        aux, final = capture(target, layout, ids, attn)
        for b, n in enumerate(lens):
            buf.add(Sample(ids[b, :n], attn[b, :n], aux[b, :n].clone(), final[b, :n].clone()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.safetensors"
        buf.write(path)
        bytes_per_token = path.stat().st_size / tokens
    ideal = (3 + 1) * target.hidden_size * 2

    print(f"tokens per pass: {tokens} in {len(batches)} batches, {torch.get_num_threads()} threads")
    print(f"plain forward (no capture): {tps['plain']:8.1f} tok/s")
    print(f"capture forward:            {tps['capture']:8.1f} tok/s")
    print(f"throughput ratio capture/plain: {tps['capture'] / tps['plain']:.3f}  (goal >= 0.90)")
    print(f"bytes per token: {bytes_per_token:.1f} vs (3+1)*H*2 = {ideal}  ratio {bytes_per_token / ideal:.4f}"
          "  (goal <= 1.05)")


if __name__ == "__main__":
    main()

"""Extractor benchmark: tokens/s of the extractor's capture path vs a plain forward without capture, on the same
batches, run side by side (interleaved), and bytes per token of the written shards vs (3+1)·H·2.

The capture path is the extractor's own (services.extractor.shards): the forward with aux-layer hooks, the states
gathered on the target's device, copied to the host (on a side stream into pinned memory on a GPU) and taken by
the background writer thread; only the shard files are left out. On a GPU the goal is ≥ 0.90.

    .venv/bin/python bench/extractor.py [--samples 48] [--repeats 3]     # EYAS_DEVICE / EYAS_DTYPE apply
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eyas.capture import capture
from eyas.device import placement
from eyas.features import Sample, ShardBuffer
from eyas.prompts import bundled_prompt_file, load_prompts
from eyas.render import render_conversation
from eyas.settings import get_settings
from eyas.target import BUNDLED, load_target
from services.extractor.core import layout_for
from services.extractor.offload import Background, to_host
from services.extractor.plan import Item, batches
from services.extractor.shards import padded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    args = ap.parse_args()

    place = placement(get_settings())
    target = load_target(BUNDLED, place)
    layout = layout_for(target, None)
    prompts = load_prompts(bundled_prompt_file("mt_bench"))[: args.samples]
    items = []
    for p in prompts:  # MT-bench turns as stand-in conversations (both turns as user/assistant text)
        msgs = [{"role": "user", "content": p.user_turns[0]}, {"role": "assistant", "content": " ".join(p.user_turns)}]
        [r] = render_conversation(target.tokenizer, msgs)
        items.append(Item(p.id, r.input_ids, r.loss_mask))
    planned = [(padded(batch), [len(i.input_ids) for i in batch]) for batch in batches(items, args.batch_tokens)]
    tokens = sum(sum(n) for _, n in planned)
    device = target.input_device

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain():
        with torch.inference_mode():
            for (ids, attn), _ in planned:
                target.model.model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
        sync()

    def captured():
        with Background() as writer:
            for (ids, attn), _ in planned:
                writer.submit(to_host(*capture(target, layout, ids, attn)))  # the writer waits for the copy
        sync()

    plain()  # warm-up
    times = {"plain": [], "capture": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        for name, fn in (("plain", plain), ("capture", captured)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tps = {k: tokens / min(v) for k, v in times.items()}

    buf = ShardBuffer()
    for (ids, attn), lens in planned:
        aux, final = to_host(*capture(target, layout, ids, attn))()
        for b, n in enumerate(lens):
            buf.add(Sample(ids[b, :n], attn[b, :n], aux[b, :n].clone(), final[b, :n].clone()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard.safetensors"
        buf.write(path)
        bytes_per_token = path.stat().st_size / tokens
    ideal = (3 + 1) * target.hidden_size * 2

    print(f"tokens per pass: {tokens} in {len(planned)} batches on {device} ({place.dtype_name}), "
          f"{torch.get_num_threads()} threads")
    print(f"plain forward (no capture): {tps['plain']:8.1f} tok/s")
    print(f"capture path:               {tps['capture']:8.1f} tok/s")
    print(f"throughput ratio capture/plain: {tps['capture'] / tps['plain']:.3f}  (goal >= 0.90 on a GPU)")
    print(f"bytes per token: {bytes_per_token:.1f} vs (3+1)*H*2 = {ideal}  ratio {bytes_per_token / ideal:.4f}"
          "  (goal <= 1.05)")


if __name__ == "__main__":
    main()

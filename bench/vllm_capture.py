"""The extract stage's vLLM engine against the engine's plain prefill, on the same samples and batches, in one process
of vLLM's environment (the capture engine's own). bench/extractor.py measures the transformers path on the same
samples (vLLM binds this process's threads, so transformers is measured in a process of its own):

    .venv-vllm/bin/python bench/vllm_capture.py [--samples 48] [--repeats 2] [--batch-tokens 8192]

Rows: vLLM capture (services.extractor.vllm_server.VllmCapture: extract_hidden_states + Eyas's connector, the states
copied out and padded per forward batch), vLLM plain prefill (the same prompts, one token each, no speculative
config). Tokens/s is the best of the repeats. Engine start times are printed apart.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402

from eyas.device import placement  # noqa: E402
from eyas.prompts import bundled_prompt_file, load_prompts  # noqa: E402
from eyas.render import render_conversation  # noqa: E402
from eyas.settings import get_settings  # noqa: E402
from eyas.target import BUNDLED, load_target, resolve_target  # noqa: E402
from services.extractor.core import layout_for  # noqa: E402
from services.extractor.plan import Item, batches  # noqa: E402
from services.extractor.vllm_server import VllmCapture  # noqa: E402  (sets the engine environment before vLLM loads)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    place = placement(get_settings())
    target = load_target(BUNDLED, place)  # its tokenizer and layout (the engines load their own weights)
    layout = layout_for(target, None)
    items = []
    for p in load_prompts(bundled_prompt_file("mt_bench"))[: args.samples]:  # MT-bench turns as conversations
        msgs = [{"role": "user", "content": p.user_turns[0]}, {"role": "assistant", "content": " ".join(p.user_turns)}]
        [r] = render_conversation(target.tokenizer, msgs)
        items.append(Item(p.id, r.input_ids, r.loss_mask))
    planned = batches(items, args.batch_tokens)
    tokens = sum(len(i.input_ids) for i in items)
    longest = max(len(i.input_ids) for i in items)
    directory = str(resolve_target(BUNDLED))

    t0 = time.perf_counter()
    engine = VllmCapture(directory, list(layout.aux_layers), layout.num_layers, place.dtype_name, 1, longest + 1)
    start_capture = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain_llm = LLM(model=directory, dtype=place.dtype_name, max_model_len=longest + 1, enforce_eager=True,
                    enable_prefix_caching=False, seed=0)
    start_plain = time.perf_counter() - t0
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def vllm_capture() -> None:
        for batch in planned:
            engine(batch)

    def vllm_plain() -> None:
        for batch in planned:
            plain_llm.generate([TokensPrompt(prompt_token_ids=i.input_ids) for i in batch], one, use_tqdm=False)

    rows = {}
    for name, fn in (("vLLM capture", vllm_capture), ("vLLM plain prefill", vllm_plain)):
        fn()  # warm-up
        rows[name] = tokens / best(fn, args.repeats)
    print(f"{len(items)} samples, {tokens} tokens in {len(planned)} forward batches; {place.device.type} "
          f"{place.dtype_name}, torch threads {torch.get_num_threads()}; engine start: capture {start_capture:.0f} s, "
          f"plain {start_plain:.0f} s")
    print("| path | tokens/s | vs vLLM plain prefill |\n|---|---|---|")
    for name, rate in rows.items():
        print(f"| {name} | {rate:.0f} | {rate / rows['vLLM plain prefill']:.2f} |")


if __name__ == "__main__":
    main()

"""The extract stage's vLLM engine against the engine's plain prefill, on the same samples and batches, in one process
of vLLM's environment (the capture engine's own). bench/extractor.py measures the transformers path on the same
samples (vLLM binds this process's threads, so transformers is measured in a process of its own):

    .venv-vllm/bin/python bench/vllm_capture.py --data eyas-work/store/datasets/gen-… [--samples 200] [--repeats 2]

The samples are a dataset artifact's conversations (e.g. a `make run`'s), rendered as the extractor renders them.

Rows: vLLM capture (services.extractor.vllm_server.VllmCapture: extract_hidden_states + Eyas's connector, the states
copied out and padded per forward batch), vLLM plain prefill (the same prompts, one token each, no speculative
config). Tokens/s is the best of the repeats. Engine start times are printed apart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from eyas.datasets import read_conversations  # noqa: E402
from eyas.device import placement  # noqa: E402
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


def measure(path: str, args: argparse.Namespace) -> dict:
    """(a process of its own: vLLM keeps one KV connector per process) tokens/s of `path` on the data's batches."""
    from vllm import LLM, SamplingParams, TokensPrompt

    place = placement(get_settings())
    target = load_target(BUNDLED, place)  # its tokenizer and layout (the engine loads its own weights)
    layout = layout_for(target, None)
    records, _ = read_conversations(str(Path(args.data).resolve()), get_settings())
    items = [Item(rec["id"], r.input_ids, r.loss_mask) for rec in records[: args.samples]
             for r in render_conversation(target.tokenizer, rec["messages"])]
    planned = batches(items, args.batch_tokens)
    tokens = sum(len(i.input_ids) for i in items)
    longest = max(len(i.input_ids) for i in items)
    directory = str(resolve_target(BUNDLED))
    t0 = time.perf_counter()
    if path == "capture":
        engine = VllmCapture(directory, list(layout.aux_layers), layout.num_layers, place.dtype_name, 1, longest + 1)

        def run() -> None:
            for batch in planned:
                engine(batch)
    else:
        llm = LLM(model=directory, dtype=place.dtype_name, max_model_len=longest + 1, enforce_eager=True,
                  enable_prefix_caching=False, seed=0)
        one = SamplingParams(max_tokens=1, temperature=0.0)

        def run() -> None:
            for batch in planned:
                llm.generate([TokensPrompt(prompt_token_ids=i.input_ids) for i in batch], one, use_tqdm=False)
    start = time.perf_counter() - t0
    run()  # warm-up
    return {"path": path, "samples": len(items), "tokens": tokens, "batches": len(planned), "start_s": start,
            "tok_s": tokens / best(run, args.repeats), "device": place.device.type, "dtype": place.dtype_name}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a dataset artifact (directory or URI) whose conversations to use")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--path", choices=("capture", "plain"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        print("EYAS-BENCH " + json.dumps(measure(args.path, args)), flush=True)
        return
    rows = {}
    for path in ("capture", "plain"):  # each in a fresh process
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--path", path], check=True, text=True,
                             stdout=subprocess.PIPE).stdout
        rows[path] = json.loads(next(x for x in out.splitlines() if x.startswith("EYAS-BENCH "))[len("EYAS-BENCH "):])
    c = rows["capture"]
    print(f"{c['samples']} samples, {c['tokens']} tokens in {c['batches']} forward batches; {c['device']} {c['dtype']}")
    print("| path | tokens/s | vs vLLM plain prefill | engine start (s) |\n|---|---|---|---|")
    for name, r in (("vLLM capture (Eyas's engine)", rows["capture"]), ("vLLM plain prefill", rows["plain"])):
        print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / rows['plain']['tok_s']:.2f} | {r['start_s']:.0f} |")


if __name__ == "__main__":
    main()

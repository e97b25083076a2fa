"""The extract stage's vLLM engine against the engine's plain prefill, on the same samples and batches, in one process
of vLLM's environment (the capture engine's own). bench/extractor.py measures the transformers path on the same
samples (vLLM binds this process's threads, so transformers is measured in a process of its own):

    .venv-vllm/bin/python bench/vllm_capture.py --data eyas-work/store/datasets/gen-… [--samples 200] [--repeats 2]
    .venv-vllm/bin/python bench/vllm_capture.py --model DIR --rows 4 --length 2048 --batches 8 [--json]

The samples are a dataset artifact's conversations (e.g. a `make run`'s), rendered as the extractor renders them, on
the bundled target; or, with --model, a target directory of its own (config and weights; a tokenizer is not needed)
fed random token batches of rows × length: bench/gpu.py's batches (the same recipe and seed), its random target.

Rows: vLLM capture (services.extractor.vllm_server.VllmCapture: extract_hidden_states + Eyas's connector, the states
copied out and padded per forward batch), vLLM plain prefill (the same prompts, one token each, no speculative
config). Tokens/s is the best of the repeats. Engine start times are printed apart. --json prints one JSON line
instead of the table: {"tokens", "ids_sum", "capture_tok_s", "plain_tok_s", "ratio", "capture_start_s",
"plain_start_s", "device", "dtype"}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from eyas.datasets import read_conversations  # noqa: E402
from eyas.device import placement  # noqa: E402
from eyas.layout import default_aux_layers  # noqa: E402
from eyas.render import render_conversation  # noqa: E402
from eyas.settings import get_settings  # noqa: E402
from eyas.target import BUNDLED, load_target, resolve_target  # noqa: E402
from services.extractor.core import layout_for  # noqa: E402
from services.extractor.plan import Batch, Item, batches  # noqa: E402
from services.extractor.vllm_server import VllmCapture  # noqa: E402  (sets the engine environment before vLLM loads)


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def random_batches(vocab_size: int, rows: int, length: int, n: int, seed: int) -> list[Batch]:
    """bench/gpu.py's extraction batches: n batches of rows × length ids drawn from [3, vocab) in this order."""
    gen = torch.Generator().manual_seed(seed)
    drawn = [torch.randint(3, vocab_size, (rows, length), generator=gen) for _ in range(n)]
    return [[Item(f"r{b}-{i}", row.tolist(), [1] * length) for i, row in enumerate(ids)] for b, ids in enumerate(drawn)]


def workload(args: argparse.Namespace) -> tuple[str, list[int], int, str, list[Batch]]:
    """(target directory, layout's aux layers, layers, dtype, forward batches) of --data or --model."""
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        layers = config["num_hidden_layers"]
        planned = random_batches(config["vocab_size"], args.rows, args.length, args.batches, args.seed)
        return args.model, list(default_aux_layers(layers)), layers, args.dtype, planned
    place = placement(get_settings())
    target = load_target(BUNDLED, place)  # its tokenizer and layout (the engine loads its own weights)
    layout = layout_for(target, None)
    records, _ = read_conversations(str(Path(args.data).resolve()), get_settings())
    items = [Item(rec["id"], r.input_ids, r.loss_mask) for rec in records[: args.samples]
             for r in render_conversation(target.tokenizer, rec["messages"])]
    return (str(resolve_target(BUNDLED)), list(layout.aux_layers), layout.num_layers, place.dtype_name,
            batches(items, args.batch_tokens))


def measure(path: str, args: argparse.Namespace) -> dict:
    """(a process of its own: vLLM keeps one KV connector per process) tokens/s of `path` on the forward batches."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.platforms import current_platform

    from services.extractor.vllm_server import has_tokenizer

    directory, aux_layers, num_layers, dtype, planned = workload(args)
    items = [i for b in planned for i in b]
    tokens = sum(len(i.input_ids) for i in items)
    longest = max(len(i.input_ids) for i in items)
    t0 = time.perf_counter()
    if path == "capture":
        engine = VllmCapture(directory, aux_layers, num_layers, dtype, 1, longest + 1)

        def run() -> None:
            for batch in planned:
                engine(batch)
    else:
        llm = LLM(model=directory, dtype=dtype, max_model_len=longest + 1, enforce_eager=True,
                  enable_prefix_caching=False, seed=0, skip_tokenizer_init=not has_tokenizer(directory))
        one = SamplingParams(max_tokens=1, temperature=0.0)

        def run() -> None:
            for batch in planned:
                llm.generate([TokensPrompt(prompt_token_ids=i.input_ids) for i in batch], one, use_tqdm=False)
    start = time.perf_counter() - t0
    run()  # warm-up
    return {"path": path, "samples": len(items), "tokens": tokens, "ids_sum": sum(sum(i.input_ids) for i in items),
            "batches": len(planned), "start_s": start, "tok_s": tokens / best(run, args.repeats),
            "device": current_platform.device_type, "dtype": dtype}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a dataset artifact (directory or URI) whose conversations to use")
    source.add_argument("--model", help="a target directory (config + weights) fed random token batches")
    ap.add_argument("--samples", type=int, default=200, help="--data: conversations to use")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="--data: padded tokens per forward batch")
    ap.add_argument("--rows", type=int, default=4, help="--model: samples per forward batch")
    ap.add_argument("--length", type=int, default=2048, help="--model: tokens per sample")
    ap.add_argument("--batches", type=int, default=8, help="--model: forward batches")
    ap.add_argument("--seed", type=int, default=0, help="--model: the random batches' seed")
    ap.add_argument("--dtype", default="bfloat16", help="--model: the engine's dtype")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
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
    c, p = rows["capture"], rows["plain"]
    if args.json:
        print(json.dumps({"tokens": c["tokens"], "ids_sum": c["ids_sum"], "capture_tok_s": c["tok_s"],
                          "plain_tok_s": p["tok_s"], "ratio": c["tok_s"] / p["tok_s"], "capture_start_s": c["start_s"],
                          "plain_start_s": p["start_s"], "device": c["device"], "dtype": c["dtype"]}), flush=True)
        return
    print(f"{c['samples']} samples, {c['tokens']} tokens in {c['batches']} forward batches; {c['device']} {c['dtype']}")
    print("| path | tokens/s | vs vLLM plain prefill | engine start (s) |\n|---|---|---|---|")
    for name, r in (("vLLM capture (Eyas's engine)", c), ("vLLM plain prefill", p)):
        print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / p['tok_s']:.2f} | {r['start_s']:.0f} |")


if __name__ == "__main__":
    main()

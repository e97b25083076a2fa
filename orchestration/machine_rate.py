"""The first seconds of `eyas run --minutes N`: what each stage's time is made of on this machine, with the target
the run trains for (orchestration/budget.py plans from these rates, and re-plans as the stages measure their own):
  decode    new tokens/s of in-process generation at the run's batch and at half of it (prompt synthesis and
            the answers run in balanced batches of between the two)
  forward   target forward tokens/s over whole conversations (extraction)
  train     drafter TTT training tokens/s at the CPU preset (a few steps on random states of the target's widths,
            in a batch shaped like the run's)
  validate  the same batch's tokens/s forward only (the trainer's validation passes)
  step      seconds of one single-sequence target step with a KV cache (the evaluator's in-process speculative
            decoding goes token by token)
Each rate is the fastest of READINGS readings. A machine busy through all of them still reads low here: the plan is
only the stages' first shares, and each stage works to a deadline.
"""
from __future__ import annotations

import time
from dataclasses import asdict, fields, replace

from eyas.layout import default_aux_layers
from orchestration.budget import ANSWER_FILL, ANSWER_TOKENS, PROMPT_TOKENS, Rates
from services.trainer.spec import CPU_PRESET

# Each rate is read this many times, the setting up (model loads, warm-ups) once, and the fastest reading kept:
# other work on the machine only ever slows a reading (timeit's rule). A hog in the run's first minute made one
# reading of decoding several times slow while the readings after it were quiet, and a plan from that one reading
# starved training (bench/README.md § Measured defaults).
READINGS = 2


def measure_rates(target_name: str, batch: int) -> Rates:
    """The rates on this machine, in a few seconds, with the stages' own code paths where they have one: each the
    fastest of READINGS readings."""
    import torch

    from services.generator.engine import InProcessEngine
    from services.generator.spec import SamplingParams

    engine = InProcessEngine(target_name, max_batch=batch)
    model = engine.target.model
    params = SamplingParams(max_tokens=16, temperature=0.0)
    # a few words, no chat template: the probe times decoding steps, not the prompts' prefill
    texts = [f"A fact about the number {i}:" for i in range(batch)]
    engine.generate_texts(texts[:2], params.model_copy(update={"max_tokens": 2}))  # warm-up
    ids = torch.randint(0, model.config.vocab_size, (4, 256))
    with torch.inference_mode():
        model(input_ids=ids[:1, :16])  # warm-up

    drafter, head, fake, cached, opt = _training_probe(model, ids)

    def read() -> Rates:
        decode = []
        for n_rows in (batch, max(1, batch // 2)):
            t0 = time.perf_counter()
            done = engine.generate_texts(texts[:n_rows], params)
            decode.append(sum(c.completion_tokens for c in done) / (time.perf_counter() - t0))
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(input_ids=ids, output_hidden_states=True)
            forward = ids.numel() / (time.perf_counter() - t0)
            out = model(input_ids=ids[:1, :64], use_cache=True)
            t1 = time.perf_counter()
            for i in range(8):
                out = model(input_ids=ids[:1, 64 + i:65 + i], past_key_values=out.past_key_values, use_cache=True)
            step = (time.perf_counter() - t1) / 8
        tokens = fake.input_ids.numel()
        return Rates(decode_tok_s=decode[0], decode_half_tok_s=decode[1], forward_tok_s=forward,
                     train_tok_s=tokens / min(_train_step_s(drafter, fake, head, opt) for _ in range(2)),
                     val_tok_s=tokens / min(_train_step_s(drafter, cached, head, None) for _ in range(2)),
                     step_s=step)

    return fastest([read() for _ in range(READINGS)])


def _training_probe(model, ids):
    """A drafter of the preset's shape for `model`, with its optimizer, and a batch shaped like the run's (rows of a
    prompt and its answer up to the preset's batch tokens, loss on the answers only: the lm_head runs on those), raw
    and with the target's argmax cached as the trainer caches it for validation; each warmed up."""
    import torch

    from eyas.batching import Batch
    from eyas.drafter import Drafter, DrafterConfig
    from eyas.ttt import label_rows, target_top

    cfg = model.config
    torch.manual_seed(0)
    vocab = CPU_PRESET["draft_vocab_size"]
    n_aux = len(default_aux_layers(cfg.num_hidden_layers))
    drafter = Drafter(DrafterConfig.from_target(cfg, vocab, num_aux=n_aux))
    drafter.set_vocab(torch.arange(vocab))
    head = model.get_output_embeddings().weight.detach()
    h = cfg.hidden_size
    prompt, n = PROMPT_TOKENS, PROMPT_TOKENS + round(ANSWER_FILL * ANSWER_TOKENS)
    rows = CPU_PRESET["batch_tokens"] // n
    mask = torch.zeros(rows, n, dtype=torch.int64)
    mask[:, prompt:] = 1
    fake = Batch(input_ids=ids.reshape(-1)[:rows * n].view(rows, n), loss_mask=mask,
                 lengths=torch.full((rows,), n), aux_hidden=torch.randn(rows, n, n_aux * h),
                 final_hidden=torch.randn(rows, n, h))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    _train_step_s(drafter, fake, head, opt)  # warm-up
    # validation: forward only
    cached = replace(fake, target_top=target_top(fake.final_hidden, head, label_rows(mask)))
    _train_step_s(drafter, cached, head, None)  # warm-up
    return drafter, head, fake, cached, opt


def _train_step_s(drafter, batch, head, opt) -> float:
    """Seconds of one TTT step on `batch`: forward, backward and the optimizer's step; forward only without `opt`."""
    import torch

    from eyas.ttt import ttt_forward

    t0 = time.perf_counter()
    if opt is None:
        with torch.no_grad():
            ttt_forward(drafter, batch, head, CPU_PRESET["ttt_steps"])
    else:
        ttt_forward(drafter, batch, head, CPU_PRESET["ttt_steps"]).loss.backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0


def fastest(readings: list[Rates]) -> Rates:
    """Each rate's fastest reading (the highest tokens/s, the shortest step)."""
    return Rates(**{f.name: (min if f.name == "step_s" else max)(getattr(r, f.name) for r in readings)
                    for f in fields(Rates)})


def rates_line(rates: Rates) -> str:
    r = asdict(rates)
    return (f"measured: decode {r['decode_tok_s']:.0f} tok/s ({r['decode_half_tok_s']:.0f} at half the batch), "
            f"forward {r['forward_tok_s']:.0f} tok/s, train {r['train_tok_s']:.0f} tok/s "
            f"(validate {r['val_tok_s']:.0f}), target step {1000 * r['step_s']:.0f} ms")

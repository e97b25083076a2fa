"""The trainer at scale: activation checkpointing (the draft-vocabulary logits recomputed in the backward pass
instead of kept: the same loss and gradients, fewer saved activations), and training across nodes through
torchrun's rendezvous with the command docs/operations.md gives, exported by a train job that resumes its artifact."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.batching import collate
from eyas.drafter import Drafter, DrafterConfig
from eyas.features import Sample
from eyas.ttt import ttt_forward


def _saved_bytes_and_grads(drafter: Drafter, batch, head: torch.Tensor, recompute: bool):
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    drafter.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = ttt_forward(drafter, batch, head, steps=3, recompute=recompute)
    r.loss.backward()
    return r, saved, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}


def test_recomputed_logits_give_the_same_gradients_with_less_saved():
    V, Vd, H, T = 512, 512, 32, 48  # a full draft vocabulary: the logits dominate the activations
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, rms_norm_eps=1e-6, vocab_size=V, draft_vocab_size=Vd, target_hidden_size=H,
                        num_aux=3, rope_theta=10000.0, max_position_embeddings=256)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    drafter = Drafter(cfg)
    drafter.set_vocab(torch.arange(Vd))
    samples = [Sample(torch.randint(0, V, (T,), generator=g), torch.ones(T, dtype=torch.long),
                      torch.randn(T, 3 * H, generator=g), torch.randn(T, H, generator=g)) for _ in range(2)]
    batch, head = collate(samples), torch.randn(V, H, generator=g)

    kept, kept_bytes, kept_grads = _saved_bytes_and_grads(drafter, batch, head, recompute=False)
    again, again_bytes, again_grads = _saved_bytes_and_grads(drafter, batch, head, recompute=True)
    assert torch.equal(kept.objective, again.objective) and torch.equal(kept.correct, again.correct)
    for name, grad in kept_grads.items():
        torch.testing.assert_close(again_grads[name], grad, rtol=1e-5, atol=1e-7)
    logits = 3 * int(kept.count[0]) * Vd * 4  # one fp32 [N, Vd] per TTT step (N ≤ the step-0 count)
    assert kept_bytes - again_bytes >= logits


def test_two_nodes_through_torchrun_rendezvous_train_what_two_processes_train(tmp_path):
    """Two torchrun agents ("nodes" of one process each) meet at one c10d rendezvous and train into an artifact; a
    train job resuming it exports the drafter. The same spec as one job with 2 processes: the same drafter."""
    from eyas.settings import Settings
    from orchestration.embedded import EmbeddedRunner
    from services.trainer.spec import Spec
    from tests.datasets import CONVERSATIONS, write_records
    from tests.families import FAMILIES, build_target
    from tests.servers import free_port
    from tests.test_evaluator import local_path

    target = str(build_target(FAMILIES["llama3"], tmp_path / "llama3"))
    records = [{"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for i, (q, a) in enumerate(CONVERSATIONS * 2)]
    runner = EmbeddedRunner(Settings(workdir=tmp_path / "w", input_roots=[tmp_path]))
    [extract] = runner.run_job("extract", {"data": write_records(tmp_path / "data", records, target=target),
                                           "target": target})
    spec = {"features": extract.artifacts["output"], "ttt_steps": 2, "draft_vocab_size": 64, "steps": 3,
            "warmup": 1, "val_every": 4, "val_interval": 0, "batch_tokens": 256}

    endpoint, out = f"127.0.0.1:{free_port()}", tmp_path / "multinode"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=drafter-1",
               "-m", "services.trainer.train", "--spec", Spec(**spec).model_dump_json(), "--output", str(out)]
    env = {**os.environ, "EYAS_DEVICE": "cpu"}
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]

    [exported] = runner.run_job("train", {**spec, "resume": str(out)})
    [together] = runner.run_job("train", {**spec, "processes": 2})
    assert exported.state == together.state == "succeeded", (exported.error, together.error)
    assert exported.metrics["steps"] == together.metrics["steps"] == 3
    a, b = (load_file(local_path(j.artifacts["output"]) / "eagle" / "model.safetensors") for j in (exported, together))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    assert Path(local_path(exported.artifacts["output"]) / "manifest.json").is_file()

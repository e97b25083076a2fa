"""The vLLM capture engine: the target served by vLLM with its extract_hidden_states method and Eyas's connector
(services.extractor.vllm_connector), in vLLM's own environment, writing the shards its parent sends it straight
into the job's artifact. One engine serves job after job (services.extractor.vllm_backend starts it once per
worker process).

    $VLLM_PYTHON -m services.extractor.vllm_server --target DIR --aux-layers 1,14,26 --num-layers 30 \
        --dtype float32 [--tensor-parallel-size N] [--max-model-len N]

stdin, one JSON object a line:
    {"output": URI}                                 a job: the artifact its shards go into
    {"index": I, "obj": NAME, "batches": [[[id, input_ids, loss_mask], …], …]}   one planned shard
    {"end": true}                                   the job's last shard was sent: DONE once all are uploaded
stdout, tagged lines (anything else is the engine's log): READY once the engine is up; NEXT as it takes a shard
(the parent may send the next); PROGRESS <tokens> after each forward batch; UPLOADED {"obj", "entry"} after each
shard's upload; DONE at a job's end. Layer ids are vLLM's: id i is the input of layer i, i.e. out(i-1) in
eyas.layout's numbering; the final state is the last layer's output (id L) through the model's final norm.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

# before vLLM is imported: the engine runs in this process, so the connector's captured states are a call away
# (tensor parallel ranks run in vLLM's worker processes: LLM.collective_rpc reaches them)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# the CPU backend: its KV cache in GiB (else it reserves most of the machine's memory); a prompt's blocks are freed
# as soon as its one token is out
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# max_model_len is the longest sample + 1 (the engine samples one token after each prompt, which it never runs):
# a sample as long as the target's context is captured, which vLLM would otherwise refuse
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"

import torch  # noqa: E402

from eyas.capture import Captured  # noqa: E402
from eyas.manifest import ArtifactWriter, FileEntry  # noqa: E402
from eyas.settings import get_settings  # noqa: E402
from eyas.store import open_artifact  # noqa: E402
from services.extractor.plan import Batch, Item  # noqa: E402
from services.extractor.shards import write_shards  # noqa: E402
from services.extractor.vllm_protocol import DONE, NEXT, PROGRESS, READY, UNSUPPORTED, UPLOADED  # noqa: E402

CONNECTOR_MODULE = "services.extractor.vllm_connector"


def vllm_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """vLLM's ids for the layout's out(i) layers (id i+1: the input of layer i+1), then the last layer's output."""
    return [i + 1 for i in aux_layers] + [num_layers]


def has_tokenizer(target: str) -> bool:
    """Whether the target's directory holds a tokenizer. The engine needs none (token ids in, states out), but
    vLLM logs a traceback at start without one (its chat-template warm-up), so one is loaded where it exists."""
    return any((Path(target) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json",
                                                           "tokenizer.model"))


def bind_cpu_ranks(tensor_parallel_size: int) -> None:
    """vLLM-CPU binds each tensor-parallel rank's OpenMP threads to a NUMA node of its own
    (VLLM_CPU_OMP_THREADS_BIND=auto) and refuses more ranks than nodes ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers"): with fewer nodes, each rank gets an equal share of this process's cores
    instead ("0|1" on two cores). A binding set in the environment is kept; GPUs are left alone."""
    from vllm.platforms import current_platform

    if tensor_parallel_size < 2 or not current_platform.is_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) >= tensor_parallel_size:
        return
    cpus, n = sorted(os.sched_getaffinity(0)), tensor_parallel_size
    shares = [cpus[r * len(cpus) // n: (r + 1) * len(cpus) // n] for r in range(n)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, s)) for s in shares) if all(shares) \
        else "nobind"  # fewer cores than ranks: the ranks share them


class VllmCapture:
    """eyas' Capture (services.extractor.shards) on a vLLM engine: a forward batch's samples as one generate call of
    one token each, their states taken from the connector. Token ids in, states out: a target without a tokenizer
    (bench/gpu.py's random one) is captured too. Tensor parallel ranks run in vLLM's worker processes (its mp
    executor); every rank captures, rank 0's states are taken."""

    def __init__(self, target: str, aux_layers: list[int], num_layers: int, dtype: str, tensor_parallel_size: int,
                 max_model_len: int):
        from vllm import LLM

        bind_cpu_ranks(tensor_parallel_size)
        ids = vllm_layer_ids(aux_layers, num_layers)
        order = sorted(set(ids))  # the connector's layer axis: vLLM sorts the ids
        self.aux_cols = [order.index(i) for i in ids[:-1]]
        self.final_col = order.index(num_layers)
        self.keys = itertools.count()
        self.captured = Captured(target, tuple(aux_layers))
        self.llm = LLM(
            model=target, dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len,
            enforce_eager=True, enable_prefix_caching=False, seed=0, skip_tokenizer_init=not has_tokenizer(target),
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
            kv_transfer_config={"kv_connector": "EyasCaptureConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                                "kv_role": "kv_producer"})

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import SamplingParams, TokensPrompt

        from services.extractor.vllm_connector import take

        keys = [f"c{next(self.keys)}" for _ in batch]
        self.llm.generate([TokensPrompt(prompt_token_ids=item.input_ids) for item in batch],
                          [SamplingParams(max_tokens=1, temperature=0.0,
                                          extra_args={"kv_transfer_params": {"capture_key": k}}) for k in keys],
                          use_tqdm=False)
        got: dict = {}
        for part in self.llm.collective_rpc(take, args=(keys, self.final_col)):
            got.update(part)
        T = max(len(item.input_ids) for item in batch)
        states = [got[k] for k in keys]
        hidden = states[0][1].shape[-1]
        aux = torch.zeros(len(batch), T, len(self.aux_cols) * hidden, dtype=states[0][0].dtype)
        final = torch.zeros(len(batch), T, hidden, dtype=states[0][1].dtype)
        for b, (hs, normed) in enumerate(states):  # [n, n_ids, H], [n, H] → right-padded rows
            n = hs.shape[0]
            aux[b, :n] = hs[:, self.aux_cols].reshape(n, -1)  # ascending out(i), concatenated: eyas.layout's order
            final[b, :n] = normed
        return aux, final


def unsupported(target: str) -> str | None:
    """Why vLLM cannot serve the target's architecture here, or None."""
    import vllm
    from vllm.model_executor.models import ModelRegistry

    archs = json.loads((Path(target) / "config.json").read_text()).get("architectures") or []
    if any(a in ModelRegistry.get_supported_archs() for a in archs):
        return None
    return f"vLLM {vllm.__version__} does not serve {archs}"


def say(tag: str, payload: str = "") -> None:
    print(tag + payload, flush=True)


def shards_from(lines: Iterator[str], planned: dict[int, list[Batch]]) -> Iterator[tuple[int, str]]:
    """A job's shards as the parent sends them (each one's batches into `planned`), until its end line."""
    for line in lines:
        msg = json.loads(line)
        if msg.get("end"):
            return
        planned.clear()  # the shard before is captured (write_shards takes the next only then)
        planned[msg["index"]] = [[Item(*item) for item in batch] for batch in msg["batches"]]
        say(NEXT, msg["obj"])
        yield msg["index"], msg["obj"]
    raise EOFError("the parent closed stdin mid-job")


def serve(capture: VllmCapture) -> None:
    settings = get_settings()
    lines = iter(sys.stdin)
    say(READY)
    for line in lines:
        job = json.loads(line)
        output = open_artifact(job["output"], settings)
        planned: dict[int, list[Batch]] = {}

        def uploaded(obj: str, entry: FileEntry) -> None:
            say(UPLOADED, json.dumps({"obj": obj, "entry": entry.model_dump()}))

        write_shards(capture, capture.captured, planned, shards_from(lines, planned), ArtifactWriter(output),
                     lambda tokens: say(PROGRESS, str(tokens)), uploaded, job["dtype"])
        say(DONE)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target's HF directory")
    p.add_argument("--aux-layers", required=True, help="the layout's out(i) layers, comma-separated")
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    why = unsupported(args.target)
    if why:
        say(UNSUPPORTED, why)
        sys.exit(3)
    serve(VllmCapture(args.target, [int(i) for i in args.aux_layers.split(",")], args.num_layers, args.dtype,
                      args.tensor_parallel_size, args.max_model_len))


if __name__ == "__main__":
    main(sys.argv[1:])

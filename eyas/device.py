"""Where a stage computes and in which dtype, chosen once per process from the settings (EYAS_DEVICE, EYAS_DTYPE).

  device  auto: the process's GPU when CUDA is available (LOCAL_RANK under torchrun, else GPU 0), else
          the CPU; cpu; cuda (fails when no GPU is visible, instead of silently running on the CPU)
  dtype   auto: bfloat16 on a GPU, float32 on the CPU (where bf16 matmuls are slower and fp32 agreement with vLLM
          is exact); or float32 / bfloat16. A job spec's `dtype` overrides the setting for that job.

The target sits on `Placement.device`, or is spread over every visible GPU when it does not fit one
(eyas.target.load_target); the target's inputs go to its input device, captured states are gathered where their
consumer runs, and the drafter sits on the target's input device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eyas.defaults import DTypeName
from eyas.settings import Settings


@dataclass(frozen=True)
class Placement:
    device: torch.device  # the device a stage computes on (a spread target's input device is its first GPU)
    dtype: torch.dtype  # the target's weights and activations (and the evaluator's drafter)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


CPU = Placement(torch.device("cpu"), torch.float32)


def compute_device(setting: str) -> torch.device:
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("EYAS_DEVICE=cuda but no CUDA device is visible to this process")
    # torchrun gives each rank its GPU; a worker pinned with CUDA_VISIBLE_DEVICES sees its one GPU as device 0.
    # (No torch.cuda call that would create a CUDA context: a parent of torchrun ranks must not hold one.)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def placement(settings: Settings, dtype: DTypeName = "auto") -> Placement:
    """The settings' device and dtype; a job's own `dtype` (not "auto") wins over EYAS_DTYPE."""
    device = compute_device(settings.device)
    return Placement(device, compute_dtype(settings.dtype if dtype == "auto" else dtype, device))

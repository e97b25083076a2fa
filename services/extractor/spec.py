"""The extract job's spec: the conversations to extract from, the target and its aux layers, how samples are cut
and batched, and how many processes extract."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eyas.confine import names
from eyas.device import DTypeName
from eyas.stage import StageSpec
from eyas.target import BUNDLED


class Spec(StageSpec):
    data: names("artifact") = Field(
        description="conversations artifact URI (s3://bucket/datasets/ID) or local directory")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="target model: HF directory (under an input root) or the bundled name")
    aux_layers: list[Annotated[int, Field(ge=-1, le=1023)]] | None = Field(
        None, max_length=64, description="physical out(i) layers; default out(1), out(L//2-1), out(L-4)")
    max_length: int = Field(2048, ge=16, le=131072)
    overlong: Literal["truncate", "skip"] = "truncate"
    batch_tokens: int = Field(8192, ge=256, le=16_777_216, description="padded tokens per forward batch")
    shard_mb: int = Field(256, ge=1, le=4096)
    dtype: DTypeName = Field("auto", description="target compute dtype; auto: EYAS_DTYPE (bf16 on a GPU, fp32 on the "
                             "CPU). Features are stored in bf16 either way")
    processes: int | None = Field(None, ge=1, le=64, description="extractor processes under torchrun, one per GPU; "
                                  "default: one per visible GPU when the target fits one, else 1")

"""The extract job's spec: the conversations to extract from, the target and its aux layers, how samples are cut
and batched, and how many processes extract."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eyas.confine import names
from eyas.defaults import BUNDLED, DTypeName
from eyas.layout import BF16, FP8
from eyas.stage import StageSpec, integral_floats


class StreamSpec(BaseModel):
    """Extract while a train job trains on the shards as they land (eyas.handoff)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # as StageSpec: JSON says what it means
    policy: Literal["first_epoch", "recompute"] = Field(
        description="first_epoch: extract once, in artifact order, and keep the shards for later epochs; "
        "recompute: extract every epoch again and keep at most max_store_gb of features")
    epochs: int = Field(1, ge=1, le=1000, description="recompute: epochs to extract (the train job's, rounded up)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="recompute: each epoch's shard order is shuffled by "
                      "(seed, epoch)")
    max_store_gb: float = Field(16.0, gt=0, le=1_000_000, description="features stored at once, at most (two "
                                "windows of half this, plus a shard per extractor process); the train job's "
                                "cache_gb must be at least this")

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: Any) -> Any:
        return integral_floats(cls, data)


class Spec(StageSpec):
    data: names("artifact") = Field(
        description="conversations artifact URI (s3://bucket/datasets/ID) or local directory")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="target model: HF directory (under an input root) or the bundled name")
    aux_layers: list[Annotated[int, Field(ge=-1, le=1023)]] | None = Field(
        None, max_length=64, description="physical out(i) layers; default out(1), out(L//2-1), out(L-4)")
    max_length: int = Field(2048, ge=16, le=131072, description="most tokens of one sample (see overlong)")
    overlong: Literal["truncate", "skip"] = Field("truncate", description="a sample longer than max_length: "
                                                  "truncate it to max_length, or skip it (counted in the manifest)")
    batch_tokens: int = Field(8192, ge=256, le=16_777_216, description="padded tokens per forward batch")
    shard_mb: int = Field(256, ge=1, le=4096, description="most MiB of features in a shard file (a shard closes "
                          "before the sample that would pass it; a sample bigger than this gets a shard of its own): "
                          "the unit a trainer's cache holds and a stream hands off")
    dtype: DTypeName = Field("auto", description="target compute dtype; auto: EYAS_DTYPE (bf16 on a GPU, fp32 on the "
                             "CPU). How features are stored is features_dtype")
    features_dtype: Literal["bfloat16", "float8_e4m3fn"] = Field(
        BF16, description=f"how shards store the aux and final states (the layout's dtype): {BF16}, or {FP8} "
        "(e4m3 with a float32 scale per token and per state: about half the bytes; every reader dequantizes)")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto", description="what runs the target: vllm (the serving engine, its extract_hidden_states method, "
        "tensor parallel over the node's GPUs) or transformers (forward hooks, torchrun processes); auto: the "
        "deployment's choice (EYAS_EXTRACT_ENGINE), else vllm where its environment is installed and it serves "
        "the target's architecture, else transformers. The features manifest records which ran")
    tensor_parallel_size: int | None = Field(None, ge=1, le=64, description="vllm: ranks the engine spreads the target "
                                             "over (GPUs; on a CPU, shares of its cores); default: every visible GPU "
                                             "(1 on the CPU)")
    processes: int | None = Field(None, ge=1, le=64, description="transformers: extractor processes under "
                                  "torchrun, one per GPU; default: one per visible GPU when the target fits one, "
                                  "else 1")
    stream: StreamSpec | None = Field(None, description="hand the features to a train job while extracting (its "
                                      "`then`: train starts at once); default: extract everything first")
    max_workers: int = Field(4, ge=1, le=256, description="with a stream: most extract workers that share its "
                             "shards where several run (service mode: its own and helpers the stage's queue "
                             "reaches, each with a target of its own); 1 = its own only")

    def hands_off_early(self) -> bool:
        return self.stream is not None

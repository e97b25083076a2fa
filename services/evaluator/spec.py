"""The evaluate job's spec: the drafter (and target) to evaluate, the prompts it is scored on, how much of them is
decoded, and the optional live vLLM endpoints."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from eyas.confine import names
from eyas.defaults import BUNDLED, DEFAULT_CACHE_GB, DTypeName
from eyas.prompts import BUNDLED_NAMES
from eyas.stage import UNIX_TIME_MAX, StageSpec


class Spec(StageSpec):
    drafter: names("artifact") = Field(description="drafter artifact URI (s3://bucket/drafters/ID) or local directory")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="target model: HF directory (under an input root) or the bundled name")
    k: int = Field(3, ge=1, le=16, description="draft tokens per target forward (chain)")
    prompts: names("prompts", exact=BUNDLED_NAMES) = Field(
        "bundled:mt_bench", description="prompts to decode (first user turns): a prompt file, an s3:// object or "
        "bundled:NAME; MT-bench is held out from training")
    num_prompts: int = Field(20, ge=1, le=10_000, description="N prompts spread evenly over the file, one per "
                             "distinct first turn (MT-bench's 8 categories in equal shares, where the first 20 "
                             "would be writing and role play only)")
    second_prompts: names("prompts", exact=BUNDLED_NAMES) | None = Field(
        "bundled:sharegpt", description="a second held-out prompt set scored beside `prompts` (first user turns), "
        "so that a gain that fits only one benchmark shows; skipped, with the reason in the report, when the "
        "drafter was trained on it; null: none")
    second_num_prompts: int = Field(5, ge=1, le=10_000, description="N prompts of second_prompts, "
                                    "spread evenly, distinct first turns")
    max_new_tokens: int = Field(128, ge=1, le=4096, description="tokens the target generates greedily per prompt "
                                "(the drafts are replayed along them)")
    finish_by: float | None = Field(None, ge=0, le=UNIX_TIME_MAX, description="a deadline, Unix seconds: prompts are "
                                    "scored, in an order whose every prefix is spread over the file, while another "
                                    "batch and the steps after it fit before it (at least min_prompts); the report "
                                    "says how many")
    min_prompts: int = Field(16, ge=1, le=10_000, description="the fewest prompts scored under a deadline (τ's "
                             "standard error over prompts shrinks as 1/√n)")
    decode_prompts: int | None = Field(
        None, ge=1, le=10_000, description="prompts also decoded speculatively in-process, token by token (the "
        "check that the replayed τ is what real decoding counts); τ itself comes from every prompt's replay; "
        "default: all")
    features: names("artifact") | None = Field(
        None, description="features URI for accuracy (all samples); default: the drafter's own features, "
        "validation split")
    cache_gb: float = Field(DEFAULT_CACHE_GB, gt=0, le=1_000_000, description="local disk for the features the "
                            "accuracy reads, a window of shards at a time (the trainer's cache_gb)")
    batch_tokens: int = Field(8192, ge=256, le=16_777_216, description="padded tokens per accuracy batch")
    engines: list[Literal["vllm", "sglang"]] = Field(["vllm", "sglang"], max_length=2,
                                                     description="engines the wiring must fit")
    endpoint: names("endpoint") | None = Field(
        None, description="vLLM serving the target without the drafter (live A/B; EYAS_ALLOWED_ENDPOINTS)")
    spec_endpoint: names("endpoint") | None = Field(
        None, description="vLLM serving the target with this drafter (live A/B; EYAS_ALLOWED_ENDPOINTS)")
    concurrency: int = Field(1, ge=1, le=256, description="concurrent requests in the live A/B")
    live_concurrencies: list[Annotated[int, Field(ge=1, le=256)]] = Field(
        [1, 4], min_length=1, max_length=4, description="the concurrencies the serving answer is checked live at "
        "(the drafter, plain decoding and the engine's model-free methods, each on the same prompts), when the "
        "evaluator has vLLM at hand (both endpoints, or Settings.vllm_command)")
    compare_with: list[names("artifact")] = Field(
        [], max_length=8, description="reports (artifact URIs) of other drafters' evaluations for the same target, "
        "e.g. EAGLE-3 beside P-EAGLE: the serving section predicts each one's speed-up per concurrency from its τ(K) "
        "and draft cost under this engine's step times, and names the fastest at each")
    dtype: DTypeName = Field("auto", description="target and drafter dtype; auto: EYAS_DTYPE (bf16 on a GPU, fp32 "
                             "on the CPU)")

"""The diagnose job's spec (services.evaluator.diagnose runs it), apart from the diagnosis so that it loads without
torch: `eyas --help` builds the command's flags from it."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from eyas.confine import names
from eyas.defaults import BUNDLED, DTypeName
from eyas.prompts import BUNDLED_NAMES
from eyas.stage import StageSpec

K_MAX = 7  # drafts replayed per round start (τ at the job's k is read from the same runs)


class Spec(StageSpec):
    drafter: names("artifact") = Field(description="the drafter: an Eyas drafter artifact (s3://bucket/drafters/ID "
                                       "or its directory), or an EAGLE-3 export directory (config.json + "
                                       "model.safetensors: EAGLE/SpecForge layout, or a speculators checkpoint)")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="the target it drafts for: HF directory (under an input root) or the bundled name")
    k: int = Field(3, ge=1, le=K_MAX, description="draft tokens per target forward, as served")
    prompts: names("prompts", exact=BUNDLED_NAMES) = Field("bundled:mt_bench", description="prompts to measure on "
                                                           "(first user turns)")
    num_prompts: int = Field(8, ge=1, le=1000, description="N prompts spread evenly over the file")
    traffic: names("prompts", exact=BUNDLED_NAMES) | None = Field(
        None, description="a sample of your real traffic (a prompt file): τ on it beside `prompts`, per category")
    traffic_prompts: int = Field(8, ge=1, le=1000, description="N prompts of `traffic`, spread evenly")
    max_new_tokens: int = Field(64, ge=8, le=2048, description="tokens the target generates greedily per prompt "
                                "(each variant's drafts are replayed along them)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, max_length=64, description="how the served traffic is rendered, e.g. {\"enable_thinking\": false} "
        "(default: as the drafter's training data was, where its artifact records it, else the template's default)")
    expected_accuracy: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(
        None, max_length=16, description="per-position teacher-forced accuracy the drafter's training reported "
        "(e.g. [0.87, 0.7, 0.55]); default: an Eyas drafter's last validation")
    endpoint: names("endpoint") | None = Field(
        None, description="an OpenAI-compatible vLLM endpoint serving the target with this drafter: its spec-decode "
        "counters give the served τ")
    serve: bool = Field(False, description="without an endpoint: start vLLM with the drafter (EYAS_VLLM_COMMAND) "
                        "to measure the served τ")
    write_fixed: bool = Field(False, description="write the drafter with the fix applied into this job's artifact "
                              "(fixed/): config changes, d2t as offsets, fc's input blocks reordered")
    dtype: DTypeName = Field("auto", description="compute dtype; auto: EYAS_DTYPE (bf16 on a GPU, fp32 on the CPU)")

"""The generate job's spec: where prompts come from, the endpoint (or the in-process target), sampling
(SamplingParams, which the engines take per request too), and how hard to push the endpoint."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eyas.confine import names
from eyas.defaults import BUNDLED
from eyas.prompts import BUNDLED_NAMES
from eyas.stage import UNIX_TIME_MAX, StageSpec, integral_floats


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    max_tokens: int = Field(512, ge=1, le=131072, description="most tokens generated per answer")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: the smallest set of tokens whose "
                         "probabilities add up to this")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, description="sampling seed, for reproducible answers")
    chat_template_kwargs: dict[str, Any] = Field({}, max_length=64, description='passed to the chat template, '
                                                 'as JSON, e.g. \'{"enable_thinking": true}\'')

    @model_validator(mode="before")
    @classmethod
    def _json_numbers(cls, data: Any) -> Any:
        return integral_floats(cls, data)


class MixSource(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    prompts: names("prompts", exact=("synth", *BUNDLED_NAMES)) = Field(
        description="'synth' (synthesized from the target), a prompt file or bundled:NAME")
    weight: float = Field(1.0, gt=0, le=1e6,
                          description="this source's share of `limit`, relative to the other sources'")


# The sources a job may name, as the schema says it (the check is _has_source below): prompts, synthesize > 0 or
# both; or a mix (with limit) and neither.
_ONE_SOURCE = {"anyOf": [
    {"required": ["prompts"], "properties": {"prompts": {"type": "string"}, "mix": {"maxItems": 0}}},
    {"required": ["synthesize"], "properties": {"synthesize": {"minimum": 1}, "mix": {"maxItems": 0}}},
    {"required": ["mix", "limit"], "properties": {"mix": {"minItems": 1}, "limit": {"type": "integer"},
                                                  "prompts": {"type": "null"}, "synthesize": {"maximum": 0}}},
]}


class Spec(StageSpec):
    model_config = ConfigDict(json_schema_extra=_ONE_SOURCE)

    prompts: names("prompts", exact=BUNDLED_NAMES) | None = Field(
        None, description="prompt file (messages-JSONL, ShareGPT, MT-bench), s3:// object or bundled:sharegpt")
    synthesize: int = Field(0, ge=0, le=1_000_000, description="also synthesize N prompts from the target (Magpie)")
    synth_seed: int = Field(0, ge=0, le=2**32 - 1, description="seed for prompt synthesis (reproducible)")
    synth_turns: int = Field(1, ge=1, le=8, description="user turns per synthesized prompt: each follow-up is "
                             "sampled after the target's answer to the turn before (Magpie multi-turn)")
    synth_openers: list[Annotated[str, Field(max_length=200)]] | None = Field(
        None, max_length=1000, description="openers synthesized requests start with, in turn, the target writing "
        "the rest ('' = free sampling); default: a task mix across Magpie's task categories "
        "(services/generator/task_mix.py); []: free sampling only")
    mix: list[MixSource] = Field([], max_length=64,
                                 description="weighted sources instead of prompts/synthesize; needs limit")
    held_out: names("prompts", exact=BUNDLED_NAMES) | None = Field(
        "bundled:mt_bench", description="evaluation prompts kept out of training data")
    endpoint: names("endpoint") | None = Field(
        None, description="OpenAI-compatible base URL, one the service allows (EYAS_ALLOWED_ENDPOINTS); its key "
        "comes from EYAS_ENDPOINT_API_KEY; none = in-process target")
    model: str | None = Field(None, max_length=256,
                              description="served model name at the endpoint (default: the target)")
    target: names("target", exact=(BUNDLED,)) = Field(
        BUNDLED, description="the target whose chat template the data is for")
    sampling: SamplingParams = SamplingParams()
    concurrency: int = Field(16, ge=1, le=4096, description="most requests in flight at the endpoint, all workers "
                             "together; the throttle finds how many the endpoint takes, up to this")
    limit: int | None = Field(None, ge=1, le=100_000_000, description="use the first N prompts")
    max_turns: int | None = Field(None, ge=1, le=256, description="regenerate at most this many assistant turns")
    shard_size: int = Field(1000, ge=1, le=1_000_000, description="conversations per output shard file")
    initial_concurrency: int | None = Field(None, ge=1, le=4096, description="requests in flight at the start; slow "
                                            "start doubles it every round trip (default: half the concurrency, at "
                                            "least 4: concurrency within one round trip)")
    latency_factor: float = Field(4.0, ge=0, le=1000, description="congestion when answers take this many times the "
                                  "fastest time per output token seen: keep it above how much slower per token a full "
                                  "batch is than one request (2-4x on GPUs). Used where the endpoint publishes no "
                                  "queue on /metrics; 0 = off")
    max_attempts: int = Field(6, ge=1, le=100, description="tries per request before the dead-letter file")
    retry_wait_s: float = Field(0.5, gt=0, le=30, description="seconds before the first retry of a failed request, "
                                "doubled with each try up to 30 s (a longer Retry-After from the server wins)")
    request_timeout_s: float | None = Field(None, gt=0, le=86_400, description="seconds to wait for an answer "
                                            "(default: 30 + max_tokens / 2, a generation at 2 tokens/s)")
    checkpoint_every: int = Field(8, ge=1, le=1_000_000, description="finished samples per journal part "
                                  "(resume granularity)")
    max_workers: int = Field(8, ge=1, le=256, description="most generator workers that share this job where "
                             "several run (its own and the helpers its chunks of prompts reach); 1 = its own only")
    finish_by: float | None = Field(None, ge=0, le=UNIX_TIME_MAX, description="a deadline, Unix seconds: no prompt is "
                                    "started unless half of it would finish by then (as long as the last ones took), "
                                    "and the job ends with the conversations it has (the rest counted as `unreached`). "
                                    "A job that only synthesizes then draws its prompts a batch (`concurrency`) at a "
                                    "time, each answered before the next")
    synthesize_by: float | None = Field(None, ge=0, le=UNIX_TIME_MAX, description="a deadline for synthesis, Unix "
                                        "seconds: no round of candidates is drawn that would not end by then (default: "
                                        "finish_by)")

    @model_validator(mode="after")
    def _has_source(self):
        if self.prompts is None and not (self.synthesize or self.mix):  # (a bad `prompts` is named by its check)
            raise ValueError("give prompts, synthesize > 0, or mix")
        if self.mix and (self.prompts is not None or self.synthesize):
            raise ValueError("mix replaces prompts/synthesize; give one or the other")
        if self.mix and not self.limit:
            raise ValueError("a mix needs limit (the total number of prompts to split by weight)")
        return self

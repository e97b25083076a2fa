"""The refresh's settings (environment prefix EYAS_REFRESH_; `eyas refresh` flags override them)."""
from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from eyas.defaults import BUNDLED


class RefreshSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYAS_REFRESH_", env_file=".env", env_ignore_empty=True,
                                      extra="ignore")

    name: str = Field("default", pattern=r"^[\w.-]+$", description="the promotion line: its current drafter, the "
                      "ones before it and every promotion record are kept under promotion/NAME/ in the store")
    drafter: str | None = Field(None, description="the current drafter's artifact (DIR or s3://…) (default: the "
                                "drafter promoted last under NAME)")
    target: str = Field(BUNDLED, description="the target as served now (HF directory or the bundled name): the "
                        "answers are regenerated with it; a drafter trained for another one (config or tokenizer "
                        "hash) is not warm-started from, a new one is trained")
    endpoint: str | None = Field(None, description="OpenAI-compatible endpoint serving the target, for the "
                                 "regenerated answers (default: in-process)")
    traffic_prefix: str = Field("traffic", pattern=r"^[\w.-]+(/[\w.-]+)*$",
                                description="store folder of the recorded windows (eyas proxy's --prefix)")
    since_hours: float = Field(168.0, gt=0, description="read the windows that started at most this many hours ago")
    prompts: int = Field(200, ge=1, le=1_000_000, description="the budget: training prompts drawn from the recent "
                         "traffic, weighted toward those the current drafter accepts least")
    pool: int = Field(400, ge=1, le=1_000_000, description="most recent prompts scored by the current drafter's "
                      "acceptance (replayed on the target's answers) before the draw; when no more than --prompts "
                      "are left, all are taken and none is scored")
    heldout_share: float = Field(0.1, gt=0, lt=1, description="share of the deduplicated recent prompts held out "
                                 "(chosen by a hash of the prompt's text, so a prompt is held out in every refresh)")
    heldout_min: int = Field(2, ge=1, le=10_000, description="fewest held-out prompts")
    heldout_max: int = Field(40, ge=1, le=10_000, description="most held-out prompts (both drafters are scored on "
                             "them)")
    max_tokens: int = Field(256, ge=1, le=32_768, description="tokens per regenerated answer")
    eval_max_tokens: int = Field(128, ge=1, le=4096, description="tokens the target generates per prompt when a "
                                 "drafter is scored (the held-out comparison and the pool's scoring)")
    k: int = Field(3, ge=1, le=16, description="draft tokens per target forward, for every τ")
    steps: int | None = Field(None, ge=1, le=100_000_000, description="the budget's training steps (default: the "
                              "trainer's epochs over the drawn prompts)")
    train: dict[str, Any] = Field({}, description="further train-job fields, as JSON (e.g. '{\"lr\": 0.0005}'); "
                                  "the trainer's CPU preset is the base")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds the weighted draw")
    rollback: bool = Field(False, description="restore the drafter that was current before the last promotion "
                           "under NAME, and do nothing else")

"""The watch's settings (environment prefix EYAS_WATCH_; `eyas watch` flags override them)."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WatchSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYAS_WATCH_", env_file=".env", env_ignore_empty=True,
                                      extra="ignore")

    endpoint: str = Field(description="base URL of the vLLM endpoint that serves the drafter (its /metrics, "
                                      "/v1/models and /tokenize are read)")
    drafter: str = Field(description="the served drafter's artifact (DIR or s3://…): its layout names the target "
                                     "it was trained for")
    name: str | None = Field(None, pattern=r"^[\w.-]+$",
                             description="the series' name: it is kept under watch/NAME/ in the store "
                                         "(default: the drafter's id)")
    interval_s: float = Field(60.0, gt=0, description="seconds between two readings of the counters")
    once: bool = Field(False, description="read once, against the last stored reading (or the engine's totals), "
                                          "print the status and exit: 0 current, 1 below threshold or stale target, "
                                          "3 no traffic, 4 endpoint unreachable")
    baseline: float | None = Field(None, ge=1, description="τ measured at promotion (default: the τ `eyas refresh` "
                                                           "recorded when it promoted the drafter, else the served "
                                                           "τ, else the in-process τ, of --report or of the newest "
                                                           "report on the drafter beside it in the store)")
    report: str | None = Field(None, description="the evaluator report whose τ is the promotion level")
    min_ratio: float = Field(0.9, gt=0, le=1, description="below this share of the baseline τ the drafter is "
                                                          "below threshold")
    min_tau: float | None = Field(None, ge=1, description="an absolute τ floor, used instead of min_ratio × "
                                                          "baseline")
    window: int = Field(5, ge=1, description="the acceptance judged is over this many latest intervals together")
    min_drafts: int = Field(100, ge=1, description="fewer drafts than this in the window are too few to judge: "
                                                   "no traffic")
    plot_days: float = Field(7.0, gt=0, le=366, description="the series' picture (watch/NAME/acceptance.png, "
                             "rewritten at each reading) shows this many latest days")
    served_model: str | None = Field(None, description="the model name (or root path) the endpoint must list "
                                                       "(default: what it listed when the watch first ran)")
    target: str | None = Field(None, description="a local copy of the target (HF directory) whose tokenizer "
                                                 "renders the probe the endpoint must match (default: the drafter's "
                                                 "recorded target, else the endpoint's root where readable here)")

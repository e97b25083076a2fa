"""The loop's settings (environment prefix EYAS_LOOP_; `eyas loop` flags override them). The watch's and the refresh's
own settings are theirs (EYAS_WATCH_*, EYAS_REFRESH_*, or --watch / --refresh as JSON), but for what the loop sets:
the endpoint and drafter watched, the series' and the promotion line's name."""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from orchestration.refresh.settings import RefreshSettings
from orchestration.watch.settings import WatchSettings

# what the loop sets itself in each of them (the drafter: the line's current one, or --drafter before the first)
SETS = {"watch": {"endpoint", "drafter", "name", "interval_s", "once"},
        "refresh": {"name", "drafter", "rollback"}}


def _known(what: str, given: dict[str, Any], settings: type[BaseSettings]) -> dict[str, Any]:
    unknown = sorted(set(given) - (set(settings.model_fields) - SETS[what]))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not {what} settings the loop leaves to you; those are "
                         f"{', '.join(sorted(set(settings.model_fields) - SETS[what]))}")
    return given


class LoopSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYAS_LOOP_", env_file=".env", env_ignore_empty=True,
                                      extra="ignore")

    name: str = Field("default", pattern=r"^[\w.-]+$", description="the promotion line (promotion/NAME/ in the "
                      "store) and the watch series (watch/NAME/): the drafter watched is the line's current one")
    endpoint: str = Field(description="base URL of the vLLM endpoint that serves the drafter (its /metrics, "
                                      "/v1/models and /tokenize are read)")
    drafter: str | None = Field(None, description="the drafter the endpoint serves before the line's first "
                                "promotion (DIR or s3://…); once the line has a current drafter, that one")
    interval_s: float = Field(300.0, gt=0, description="seconds between two passes: a reading of the watch, and a "
                              "refresh when it says below threshold or stale target")
    min_refresh_hours: float = Field(24.0, ge=0, description="no refresh sooner than this after the last one began "
                                     "(the loop's), or ended (any refresh recorded on the line, `eyas refresh` too)")
    once: bool = Field(False, description="one pass (with its refresh, to the end), print it and exit with eyas "
                                          "watch --once's code: 0 current, 1 below threshold or stale target, 3 no "
                                          "traffic, 4 endpoint unreachable")
    watch: dict[str, Any] = Field({}, description="further watch settings, as JSON (eyas watch's flags, e.g. "
                                  "'{\"min_ratio\": 0.85, \"window\": 10}'); EYAS_WATCH_* are read too")
    refresh: dict[str, Any] = Field({}, description="further refresh settings, as JSON (eyas refresh's flags, e.g. "
                                    "'{\"target\": \"/models/t\", \"prompts\": 400}'); EYAS_REFRESH_* are read too")

    @field_validator("watch")
    @classmethod
    def _watch_settings(cls, given: dict[str, Any]) -> dict[str, Any]:
        return _known("watch", given, WatchSettings)

    @field_validator("refresh")
    @classmethod
    def _refresh_settings(cls, given: dict[str, Any]) -> dict[str, Any]:
        return _known("refresh", given, RefreshSettings)

    def watch_settings(self, drafter: str) -> WatchSettings:
        return WatchSettings(**{**self.watch, "endpoint": self.endpoint, "drafter": drafter, "name": self.name})

    def refresh_settings(self, drafter: str | None) -> RefreshSettings:
        return RefreshSettings(**{**self.refresh, "name": self.name, "drafter": drafter})

"""The pass-through's settings (environment prefix EYAS_PROXY_; `eyas proxy` flags override them)."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from eyas.settings import SERVICE_ENDPOINT


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EYAS_PROXY_", env_file=".env", env_ignore_empty=True,
                                      extra="ignore")

    upstream: str = Field(SERVICE_ENDPOINT, description="base URL of the OpenAI-compatible endpoint it forwards to")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8100, ge=0, le=65535, description="port to listen on")
    # Recording is the operator's decision, so it starts off: forwarding never depends on it.
    record: bool = Field(False, description="record a sample of the chat requests (the off switch; also "
                                            "POST /_eyas/recording {\"enabled\": false} while it runs)")
    sample: float = Field(0.1, ge=0, le=1, description="fraction of chat requests recorded")
    record_answers: bool = Field(False, description="record the served answers too, where the deployment allows")
    window_s: float = Field(60.0, ge=1, description="seconds of traffic in one stored object")
    retention_hours: float = Field(168.0, gt=0, description="stored windows older than this are deleted")
    max_records_per_minute: int = Field(600, ge=0, description="at most this many requests recorded per minute")
    # a request body over this is forwarded but not kept: the buffer of one window stays bounded
    max_record_bytes: int = Field(1 << 20, ge=1, description="largest request body recorded, in bytes")
    redact_default: bool = Field(True, description="mask e-mail addresses, key-like tokens and digit runs of 6+")
    redact_hook: str | None = Field(None, description="module:function (str -> str) applied after the default "
                                                      "masks to every recorded text")
    prefix: str = Field("traffic", pattern=r"^[\w.-]+(/[\w.-]+)*$", description="store folder of the recorded windows")
    upstream_timeout_s: float = Field(600.0, gt=0, description="longest wait for a byte from the upstream")

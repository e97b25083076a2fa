"""The endpoint's own account of its load, where it publishes one: requests running and waiting, read from its
Prometheus page (`/metrics` beside `/v1`). vLLM, SGLang and TGI name their scheduler gauges differently; several
series of one name (engines, models) are summed. The waiting count covers the KV cache too: vLLM and SGLang hold a
request in the queue while there is no cache room for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import httpx

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size")


@dataclass
class Load:
    running: float
    waiting: float


def parse_load(text: str) -> Load | None:
    """Running and waiting requests from a Prometheus text page; None when it has no gauge for either."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in RUNNING or name in WAITING:
            try:
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    running, waiting = [n for n in RUNNING if n in sums], [n for n in WAITING if n in sums]
    if not running or not waiting:
        return None
    return Load(running=sums[running[0]], waiting=sums[waiting[0]])


class ServerLoad:
    def __init__(self, endpoint: str):
        root = endpoint.rstrip("/")
        self.url = (root[:-3] if root.endswith("/v1") else root) + "/metrics"
        self.client = httpx.AsyncClient(timeout=5.0)

    async def read(self) -> Load | None:
        """The load now; None when the endpoint publishes none (no page, or no scheduler gauges on it). A server that
        cannot be reached raises httpx.HTTPError: it may publish again once it is back."""
        resp = await self.client.get(self.url)
        if resp.status_code in (404, 405):
            return None
        resp.raise_for_status()
        return parse_load(resp.text)

    async def aclose(self) -> None:
        await self.client.aclose()

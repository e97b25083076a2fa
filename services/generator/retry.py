"""Retry policy for one request: which failures are worth another try, how long to wait, and the dead letter a
prompt becomes when every try failed."""
from __future__ import annotations

from collections.abc import Callable

from tenacity import RetryCallState, wait_exponential_jitter

from services.generator.engine import EngineError

RETRY_STATUS = frozenset({408, 409, 425, 429})


def retryable(e: BaseException) -> bool:
    """Timeouts, connection errors, malformed responses, 408/409/425/429 and 5xx; never other 4xx."""
    return isinstance(e, EngineError) and (e.status is None or e.status in RETRY_STATUS or e.status >= 500)


def backoff(first_s: float) -> Callable[[RetryCallState], float]:
    """Waits before each retry: first_s, doubling each try up to 30 s, each plus up to first_s at random (so
    requests that failed together do not retry together), but never sooner than the server's Retry-After."""
    exponential = wait_exponential_jitter(multiplier=first_s, max=30.0, jitter=first_s)

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        return max(exponential(state), getattr(exc, "retry_after", None) or 0.0)

    return wait


class DeadLetter(Exception):
    def __init__(self, prompt_id: str, reason: str, attempts: int):
        super().__init__(reason)
        self.record = {"id": prompt_id, "error": reason, "attempts": attempts}

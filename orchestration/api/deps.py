"""Dependencies every /v1 route runs: the API key (when the service has one) and no unknown query parameters."""
# No `from __future__ import annotations`: FastAPI resolves `Depends(bearer)`, a local, from the annotation.
import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from orchestration.api.schemas import problem
from orchestration.settings import ServiceSettings


def api_key_check(settings: ServiceSettings) -> Callable[..., None]:
    bearer = HTTPBearer(auto_error=False, description="EYAS_API_KEY, when the service has one")

    def authorized(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
        if settings.api_key is None:
            return
        if cred is None or not cred.credentials:
            raise HTTPException(401, "missing API key: send Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(cred.credentials.encode(), settings.api_key.get_secret_value().encode()):
            raise HTTPException(403, "wrong API key")

    return authorized


def known_query(request: Request) -> None:
    """A misspelt query parameter (`?stat=failed`) is an error, not a silently unfiltered answer."""
    route = request.scope.get("route")
    allowed = {p.alias for p in route.dependant.query_params} if route is not None else set()
    unknown = [k for k in request.query_params if k not in allowed]
    if unknown:
        raise HTTPException(422, [problem(k, request.query_params[k], "unknown query parameter"
                                          + (f"; this route takes {sorted(allowed)}" if allowed else ""))
                                  for k in unknown])


def v1_dependencies(settings: ServiceSettings) -> list:
    """The key is documented (OpenAPI security) and checked only when the service has one."""
    return ([Depends(api_key_check(settings))] if settings.api_key is not None else []) + [Depends(known_query)]

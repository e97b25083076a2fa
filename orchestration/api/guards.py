"""ASGI guards every stage API runs before its routes:

  BodyLimit  a body over the limit is refused (413) — counted as it streams in, so a chunked body (which has no
             Content-Length) is refused too, having been read only up to the limit
  Methods    a documented path asked with a method it does not have is answered 405, and OPTIONS 204, each with
             every method the path has in Allow (Starlette names only those of the first route that matched)
  DocsKey    with an API key, the schema and its pages want the key too (they show the operator's settings)
"""
from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
from collections.abc import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestration.api.schemas import problem


def _too_large(limit: int, size: str) -> HTTPException:
    return HTTPException(413, [problem("body", size, f"request bodies are limited to {limit} bytes")])


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _answer(send, 413, {"detail": _too_large(self.limit, f"<{length.decode('latin-1')} bytes>").detail})
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # raised inside the route's body read: FastAPI passes an HTTPException through to the app's
                    # handler, which answers it like any other 4xx
                    raise _too_large(self.limit, f"<over {self.limit} bytes>")
            return message

        await self.app(scope, counted, send)


class Methods:
    """`paths()`: the documented paths (OpenAPI `paths`), each with its methods; HEAD comes with GET."""

    def __init__(self, app: ASGIApp, paths: Callable[[], dict[str, dict]]):
        self.app, self.paths = app, paths
        self._table: list[tuple[re.Pattern[str], set[str]]] | None = None

    def _allowed(self, path: str) -> set[str]:
        if self._table is None:
            self._table = []
            for template, operations in self.paths().items():
                regex = "".join("[^/]+" if part.startswith("{") else re.escape(part)
                                for part in re.split(r"(\{[^}]+\})", template))
                methods = {m.upper() for m in operations}
                self._table.append((re.compile(f"^{regex}$"), methods | ({"HEAD"} if "GET" in methods else set())))
        return set().union(*(methods for regex, methods in self._table if regex.match(path)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            allowed = self._allowed(scope["path"])
            if allowed and scope["method"] not in allowed:
                headers = {"allow": ", ".join(sorted(allowed))}
                if scope["method"] == "OPTIONS":
                    await _answer(send, 204, None, headers)
                else:
                    await _answer(send, 405, {"detail": "Method Not Allowed"}, headers)
                return
        await self.app(scope, receive, send)


class DocsKey:
    """`paths` (/openapi.json, /docs, /redoc) answered only with the key: the schema shows the operator's input roots,
    allowed endpoints, bucket and caps (the patterns and maximums that make it exact). The key comes as on /v1,
    `Authorization: Bearer <key>`, or as the password of HTTP Basic (any user name): a browser asks for that when
    /docs answers 401, and sends it again with the page's own request for /openapi.json."""

    def __init__(self, app: ASGIApp, paths: set[str], key: str):
        self.app, self.paths, self.key = app, paths, key.encode()

    def _given(self, scope: Scope) -> bytes | None:
        scheme, _, credentials = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            return credentials.strip()
        if scheme.lower() == b"basic":
            try:
                return base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in self.paths:
            given = self._given(scope)
            if not given or not hmac.compare_digest(given, self.key):
                await _answer(send, 401, {"detail": "this service's schema and docs want its API key: send "
                                                    "Authorization: Bearer <key>, or the key as the password of "
                                                    "HTTP Basic (any user name)"},
                              {"www-authenticate": 'Basic realm="Eyas API docs", charset="UTF-8"'})
                return
        await self.app(scope, receive, send)


async def _answer(send: Send, status: int, body: dict | None, headers: dict[str, str] | None = None) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if body is not None:
        raw += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})

"""The pass-through's client to its upstream: keep-alive HTTP/1.1 connections to one origin, each request written
in one write and each response read with h11 (the parser httpx itself uses). In front of httpx's client, most of
the proxy's CPU per request went to its pool, which scans every pooled connection on each request, and to writing
headers and body apart (bench/README.md § Traffic pass-through); a pass-through to one origin needs neither."""
from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import h11

READ_BYTES = 1 << 16
MAX_IDLE = 1024  # kept-alive connections beyond a burst's are closed, not kept for a burst that may not come
BODY_METHODS = (b"POST", b"PUT", b"PATCH")  # say their length even when empty; other methods send none then


class UpstreamError(ConnectionError):
    """The upstream could not be reached, or broke off before it answered."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.writer.close()


class Response:
    """Status and headers as the upstream sent them; `body()` yields its body chunk by chunk (de-chunked, never
    decompressed) and hands the connection back for the next request when the response ended cleanly."""

    def __init__(self, upstream: Upstream, conn: _Connection, head: h11.Response):
        self.upstream, self.conn = upstream, conn
        self.status = head.status_code
        self.headers = list(head.headers.raw_items())

    async def body(self) -> AsyncIterator[bytes]:
        done = False
        try:
            while True:
                event = await self.upstream.next_event(self.conn)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    done = True
                    return
                else:
                    raise UpstreamError(f"the upstream broke off the response ({type(event).__name__})")
        finally:
            self.upstream.release(self.conn, done)


class Upstream:
    def __init__(self, base_url: str, timeout_s: float):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"upstream {base_url!r}: expected http(s)://host[:port][/path]")
        self.host, self.tls = url.hostname, url.scheme == "https"
        self.port = url.port or (443 if self.tls else 80)
        self.authority = url.netloc.encode()
        self.base_path = url.path.rstrip("/").encode()
        self.timeout_s = timeout_s
        self._ssl = ssl.create_default_context() if self.tls else None
        self._idle: list[_Connection] = []

    async def _open(self) -> _Connection:
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self._ssl, limit=READ_BYTES)
        except (OSError, TimeoutError) as e:
            raise UpstreamError(f"cannot connect: {type(e).__name__}") from e
        return _Connection(reader, writer)

    async def next_event(self, conn: _Connection):
        while True:
            event = conn.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(self.timeout_s):
                    data = await conn.reader.read(READ_BYTES)
            except (OSError, TimeoutError) as e:
                raise UpstreamError(f"reading the response: {type(e).__name__}") from e
            conn.h11.receive_data(data)  # b"" is the end of the connection

    def release(self, conn: _Connection, done: bool) -> None:
        if (done and conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE
                and len(self._idle) < MAX_IDLE):
            conn.h11.start_next_cycle()
            self._idle.append(conn)
        else:
            conn.close()

    async def request(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> Response:
        """Send one request; a kept-alive connection the upstream closed meanwhile costs one retry on a new one."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reader.at_eof() or conn.writer.is_closing():  # the upstream closed it while it was idle
                conn.close()
                continue
            try:
                return await self._exchange(conn, method, target, headers, body)
            except (UpstreamError, h11.ProtocolError):
                continue  # it closed as the request went out: nothing of an answer came, so it goes again
        try:
            return await self._exchange(await self._open(), method, target, headers, body)
        except h11.ProtocolError as e:  # a request h11 will not write, or an answer it cannot read
            raise UpstreamError(f"not HTTP/1.1: {e}") from e

    async def _exchange(self, conn: _Connection, method: bytes, target: bytes,
                        headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
        length = [(b"content-length", str(len(body)).encode())] if body or method in BODY_METHODS else []
        head = [(b"host", self.authority), *headers, *length]
        try:
            out = conn.h11.send(h11.Request(method=method, target=self.base_path + target, headers=head))
            out += conn.h11.send(h11.Data(data=body)) if body else b""
            out += conn.h11.send(h11.EndOfMessage())
            conn.writer.write(out)
            while True:
                event = await self.next_event(conn)
                if isinstance(event, h11.Response):
                    return Response(self, conn, event)
                if not isinstance(event, h11.InformationalResponse):  # a 100 Continue is not the answer
                    raise UpstreamError(f"the upstream closed the connection before it answered "
                                        f"({type(event).__name__})")
        except BaseException:  # cancelled too (the client hung up): the upstream sees the connection end
            conn.close()
            raise

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

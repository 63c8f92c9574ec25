"""A small asyncio HTTP/1.1 GET client for the S3 hot path: one connection pool per process and loop.

Why not aiohttp here: it spends ~0.3 ms of client CPU per 100 KB GET (request and URL objects,
stream readers, timers per phase); this client parses the response in an
:class:`asyncio.BufferedProtocol` and receives a Content-Length body straight into a pre-sized
buffer, about half of that. GCS and Azure keep aiohttp (``_http.py``).

Scope, deliberately narrow: GET without a body, no redirects, cookies, proxies or decompression
(bytes arrive as stored). Bodies by Content-Length, ``Transfer-Encoding: chunked``, or until the
server closes. A failure is never retried here, not even on a reused keep-alive connection that the
server closed: blobdata's engine owns the one retry budget. Errors:

- :class:`ConnectionLost` (a ``ConnectionError``): closed or reset before a complete response head;
  ``OSError`` from connect/TLS passes through as is.
- :class:`IncompleteBody` (a ``ConnectionError``): closed mid-body.
- :class:`BadResponse`: not HTTP/1.x, or a head over 64 KiB.
- ``TimeoutError``: the request's deadline (connect to last byte) passed.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from collections.abc import Mapping

__all__ = ["BadResponse", "ConnectionLost", "H1Pool", "IncompleteBody", "Response"]

MAX_HEAD = 64 * 1024  # bytes of status line + headers
ERROR_BODY_CAP = 64 * 1024  # bytes kept of a non-2xx body; the connection closes when there is more
# Bytes of the per-connection receive buffer for heads, chunked and close-delimited bodies. Small on
# purpose: a Content-Length body arrives straight in its own buffer after this first read, so only
# the body bytes that share a read with the head are copied.
_READ_SIZE = 16 * 1024
_HEX_RE = re.compile(r"[0-9A-Fa-f]{1,15}")
_TARGET_RE = re.compile(r"/[^\s]*")
_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)


class BadResponse(Exception):
    """The server's bytes are not a valid HTTP/1.x response."""


class ConnectionLost(ConnectionError):
    """The connection closed or failed before a complete response head (a reused one included)."""


class IncompleteBody(ConnectionError):
    """The connection closed before the whole body arrived."""


class Headers:
    """Response headers, looked up case-insensitively; repeated headers are joined with ``", "``."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, str]) -> None:
        self._d = d  # lower-case names

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._d.get(name.lower(), default)

    def __repr__(self) -> str:
        return f"Headers({self._d!r})"


class Response:
    """A complete response: ``status``, ``headers``, ``body`` and ``content_length`` (the declared
    Content-Length in bytes, None when chunked or close-delimited). A non-2xx body is cut at 64 KiB."""

    __slots__ = ("body", "content_length", "headers", "status")

    def __init__(self, status: int, headers: Headers, body: bytes, content_length: int | None) -> None:
        self.status, self.headers, self.body, self.content_length = status, headers, body, content_length


class _Conn(asyncio.BufferedProtocol):
    """One connection: parses one response at a time into ``fut``."""

    def __init__(self, pool: H1Pool, origin: str) -> None:
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(_READ_SIZE)
        self.fut: asyncio.Future[Response] | None = None
        self.state = _DONE
        self.head = bytearray()
        self.body = bytearray()
        self.view = memoryview(self.body)
        self.got = self.need = 0  # body bytes received / wanted (Content-Length mode)
        self.length: int | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        # Chunked: bytes left of the current chunk, or -1 (a size line next), -2 (trailer), -3 (CRLF next).
        self.chunk_left = 0
        self.closed = False
        self.reused = False
        self.idle_since = 0.0  # loop time

    # -- transport callbacks -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.pool._conns.add(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.state == _LENGTH:
            return self.view[self.got : self.need]  # straight into the body: no copy
        return memoryview(self.scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.state == _LENGTH:
            self.got += nbytes
            if self.got == self.need:
                self._finish()
            return
        try:
            if self.state == _HEAD and not self.head:
                end = self.scratch.find(b"\r\n\r\n", 0, nbytes)
                if end >= 0:  # the whole head in one read (the usual case): parse it in place
                    self._start(bytes(self.scratch[:end]))
                    if nbytes > end + 4:
                        self._feed(memoryview(self.scratch)[end + 4 : nbytes])
                    return
            self._feed(memoryview(self.scratch)[:nbytes])
        except BadResponse as exc:
            self._fail(exc)
        except ValueError as exc:  # an over-long number
            self._fail(BadResponse(str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        fut = self.fut
        if self.state == _UNTIL_CLOSE and exc is None:
            self._finish()
        elif fut is not None and not fut.done():
            err: ConnectionError
            if self.state == _HEAD:
                again = " (a reused keep-alive connection)" if self.reused else ""
                err = ConnectionLost(f"the server closed the connection before responding{again}")
            else:
                err = IncompleteBody(f"the server closed the connection mid-body ({self.got} bytes)")
            err.__cause__ = exc
            fut.set_exception(err)
        self.pool._lost(self)

    # -- the request ---------------------------------------------------------------------------
    def send(self, request: bytes, fut: asyncio.Future[Response]) -> None:
        assert self.transport is not None
        self.fut, self.state, self.got = fut, _HEAD, 0
        self.transport.write(request)

    def expire(self) -> None:
        """The request's deadline passed: fail it and drop the connection."""
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(TimeoutError("no complete response before the deadline"))
        self.abort()

    def abort(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(exc)
        self.abort()

    # -- parsing -------------------------------------------------------------------------------
    def _feed(self, data: bytes | memoryview) -> None:
        state = self.state
        if state == _HEAD:
            head = self.head
            start = max(0, len(head) - 3)
            head += data
            end = head.find(b"\r\n\r\n", start)
            if end < 0:
                if len(head) > MAX_HEAD:
                    raise BadResponse(f"response head over {MAX_HEAD} bytes")
                return
            block, rest = bytes(head[:end]), bytes(head[end + 4 :])
            head.clear()
            self._start(block)
            if rest:
                self._feed(rest)
        elif state == _LENGTH:  # the body bytes that came with the head
            n = min(len(data), self.need - self.got)
            self.body[self.got : self.got + n] = data[:n]
            self.got += n
            if len(data) > n:
                self.keep_alive = False  # bytes beyond the body: the stream is out of step
            if self.got == self.need:
                self._finish()
        elif state == _CHUNKED:
            self.head += data
            self._chunks()
        elif state == _UNTIL_CLOSE:
            self.body += data
            if self.status >= 300 and len(self.body) >= ERROR_BODY_CAP:
                self._finish()
        else:  # bytes nobody asked for
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()

    def _start(self, block: bytes) -> None:
        """Parse the status line and headers, and choose how the body ends."""
        lines = block.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        code = parts[1] if len(parts) > 1 else ""
        if parts[0][:7] != "HTTP/1." or len(code) != 3 or not (code.isascii() and code.isdigit()):
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise BadResponse("unexpected protocol switch (101)")
            return  # informational: the real head follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadResponse(f"bad header line {line[:80]!r}")
            name, value = name.lower(), value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.status, self.headers = status, headers
        tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
        self.keep_alive = "close" not in tokens if parts[0] == "HTTP/1.1" else "keep-alive" in tokens
        te, cl = headers.get("transfer-encoding"), headers.get("content-length")
        self.length = None
        if status == 204 or status == 304:
            self.length = 0
        elif te is not None:
            if te.lower().rsplit(",", 1)[-1].strip() != "chunked":
                self._until_close()
                return
            self.state, self.chunk_left, self.body = _CHUNKED, -1, bytearray()
            self._chunks()
            return
        elif cl is not None:
            if not (cl.isascii() and cl.isdigit()):  # also refuses differing repeats ("3, 4")
                raise BadResponse(f"bad Content-Length {cl[:40]!r}")
            self.length = int(cl)
        else:
            self._until_close()
            return
        self.need = self.length
        if status >= 300 and self.need > ERROR_BODY_CAP:
            self.need, self.keep_alive = ERROR_BODY_CAP, False
        self.body = bytearray(self.need)
        self.view = memoryview(self.body)
        self.state = _LENGTH
        if self.need == 0:
            self._finish()

    def _until_close(self) -> None:
        self.state, self.keep_alive, self.body = _UNTIL_CLOSE, False, bytearray()

    def _chunks(self) -> None:
        """Consume what ``head`` holds of a chunked body (``head`` is free once the head is parsed)."""
        buf, body = self.head, self.body
        while buf:
            if self.status >= 300 and len(body) >= ERROR_BODY_CAP:
                self.keep_alive = False
                buf.clear()
                self._finish()
                return
            if self.chunk_left > 0:
                n = min(self.chunk_left, len(buf))
                body += buf[:n]
                del buf[:n]
                self.chunk_left -= n
                if self.chunk_left == 0:
                    self.chunk_left = -3  # the CRLF after the data
                continue
            if self.chunk_left == -3:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise BadResponse("chunk data not followed by CRLF")
                del buf[:2]
                self.chunk_left = -1
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    raise BadResponse("chunk header or trailer too long")
                return
            line = buf[:end].decode("latin-1")
            del buf[: end + 2]
            if self.chunk_left == -2:  # trailer lines until an empty one
                if not line:
                    if buf:
                        self.keep_alive = False
                    buf.clear()
                    self._finish()
                    return
                continue
            size = line.split(";", 1)[0].strip()
            if not _HEX_RE.fullmatch(size):
                raise BadResponse(f"bad chunk size {line[:40]!r}")
            self.chunk_left = int(size, 16) or -2

    def _finish(self) -> None:
        body = bytes(self.body)
        self.body = bytearray()
        self.state = _DONE
        resp = Response(self.status, Headers(self.headers), body, self.length)
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(resp)


def _expire(fut: asyncio.Future[None], what: str) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(what))


class H1Pool:
    """Keep-alive connections for one process and event loop (create and use it inside that loop).

    ``limit`` connections at most, all origins together; a request beyond it waits for a free one.
    Idle connections are reused last-in first-out and closed after ``idle_timeout`` seconds
    (default 30). ``verify`` is botocore's: True (default), False (no certificate check) or a CA
    bundle path. Hold it in :class:`blobdata._http.ProcessBound` so a forked child makes its own.
    """

    def __init__(self, limit: int, *, verify: bool | str = True, idle_timeout: float = 30.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._busy = 0  # requests holding a connection slot
        self._waiters: deque[asyncio.Future[None]] = deque()  # requests waiting for a slot, FIFO
        self._idle_timeout = idle_timeout
        self._idle: dict[str, list[_Conn]] = {}
        self._conns: set[_Conn] = set()
        self._origins: dict[str, tuple[str, int, ssl.SSLContext | None]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        self._verify = verify

    async def get(self, origin: str, target: str, headers: Mapping[str, str], timeout: float) -> Response:
        """GET ``target`` (path and query, already encoded) from ``origin`` (``http[s]://host[:port]``)
        with ``headers`` (Host included), within ``timeout`` seconds from now, connect to last byte."""
        loop = self._loop
        deadline = loop.time() + timeout
        if self._closed:
            raise ConnectionError("the connection pool is closed")
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if (
            lines.count("\n") != len(headers)
            or lines.count("\r") != len(headers)
            or not _TARGET_RE.fullmatch(target)
        ):
            raise ValueError("a header or the request target contains a line break or a space")
        request = f"GET {target} HTTP/1.1\r\n{lines}\r\n".encode("latin-1")
        if self._busy < self._limit and not self._waiters:
            self._busy += 1
        else:
            await self._wait_slot(deadline)
        conn: _Conn | None = None
        ok = False
        try:
            conn = self._take_idle(origin)
            if conn is None:
                conn = await self._connect(origin, deadline)
            fut: asyncio.Future[Response] = loop.create_future()
            conn.send(request, fut)
            timer = loop.call_at(deadline, conn.expire)
            try:
                resp = await fut
            finally:
                timer.cancel()
            ok = True
            return resp
        finally:
            if conn is not None:
                if not ok:  # failed or cancelled: may be mid-response, never reused
                    conn.abort()
                elif conn.keep_alive and not conn.closed and not self._closed:
                    self._put_idle(conn)
                elif conn.transport is not None:
                    conn.transport.close()
            self._release_slot()

    async def _wait_slot(self, deadline: float) -> None:
        """Wait for a slot until ``deadline``; a releasing request hands its slot over directly."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        timer = self._loop.call_at(deadline, _expire, fut, "no free connection before the deadline")
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release_slot()  # handed a slot, then cancelled before running: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise
        finally:
            timer.cancel()

    def _release_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._busy -= 1

    def _take_idle(self, origin: str) -> _Conn | None:
        stack = self._idle.get(origin)
        now = self._loop.time()
        while stack:
            conn = stack.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since >= self._idle_timeout:
                conn.transport.close()
                continue
            conn.reused = True
            return conn
        return None

    def _put_idle(self, conn: _Conn) -> None:
        conn.idle_since = self._loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_at(conn.idle_since + self._idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for ``idle_timeout``; run again while some stay idle."""
        self._sweeper = None
        cutoff = self._loop.time() - self._idle_timeout
        oldest = None
        for stack in self._idle.values():
            while stack and stack[0].idle_since <= cutoff:  # LIFO: the oldest are at the bottom
                conn = stack.pop(0)
                if conn.transport is not None:
                    conn.transport.close()
            if stack and (oldest is None or stack[0].idle_since < oldest):
                oldest = stack[0].idle_since
        if oldest is not None:
            self._sweeper = self._loop.call_at(oldest + self._idle_timeout, self._sweep)

    async def _connect(self, origin: str, deadline: float) -> _Conn:
        target = self._origins.get(origin) or self._parse(origin)
        host, port, ctx = target
        if len(self._conns) >= self._limit:  # an idle one for another origin: the limit is global
            stacks = [s for s in self._idle.values() if s]
            if stacks:
                victim = min(stacks, key=lambda s: s[0].idle_since).pop(0)
                victim.abort()
        # Connecting is rare (a new keep-alive connection), so a task and a closure are affordable here.
        task = self._loop.create_task(
            self._loop.create_connection(
                lambda: _Conn(self, origin), host, port, ssl=ctx, server_hostname=host if ctx else None
            )
        )
        expired = False

        def on_deadline() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = self._loop.call_at(deadline, on_deadline)
        try:
            _, conn = await task
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result()[1].abort()  # connected just as we were cancelled
            if expired:
                raise TimeoutError("no connection before the deadline") from None
            raise
        finally:
            timer.cancel()
        if self._closed:
            conn.abort()
            raise ConnectionError("the connection pool was closed")
        return conn

    def _parse(self, origin: str) -> tuple[str, int, ssl.SSLContext | None]:
        scheme, sep, hostport = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not hostport:
            raise ValueError(f"origin must be http(s)://host[:port], got {origin!r}")
        host, port = hostport, 443 if scheme == "https" else 80
        m = re.fullmatch(r"(\[[^\]]+\]|[^:]+)(?::(\d+))?", hostport)
        if m is None:
            raise ValueError(f"bad host in origin {origin!r}")
        host = m.group(1).strip("[]")
        port = int(m.group(2)) if m.group(2) else port
        ctx = self._ssl_context() if scheme == "https" else None
        self._origins[origin] = (host, port, ctx)
        return host, port, ctx

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            verify = self._verify
            ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._ssl = ctx
        return self._ssl

    def _lost(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        stack = self._idle.get(conn.origin)
        if stack and conn in stack:
            stack.remove(conn)

    async def aclose(self) -> None:
        """Close every connection, idle or busy (busy requests fail); waits up to 1 s for the sockets."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        for conn in list(self._conns):
            conn.abort()
        for i in range(200):
            if not self._conns:
                break
            await asyncio.sleep(0 if i < 20 else 0.005)

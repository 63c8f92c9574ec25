"""The wire half of :mod:`.h1`: one connection as an :class:`asyncio.BufferedProtocol` that writes a
GET and parses its response (status line, headers, a body framed by Content-Length, chunked encoding
or the server closing), plus the response and error types.

Nothing the server says decides how much memory a response takes: each request carries
``max_body``, the most bytes a 2xx body may have (the range or the listed size asked for), and a
Content-Length above it is refused before any buffer is made; chunked and close-delimited bodies
stop at it too. A non-2xx body is cut at :data:`ERROR_BODY_CAP`. The head is refused at once when
it passes :data:`MAX_HEAD` bytes, ends a line with a bare LF, or holds a bare CR; any transfer
coding but plain ``chunked`` is refused (the bytes would not be the object's). A ranged request
answered ``200`` fails at the head with :class:`RangeIgnored`, before the whole object is read.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import numpy as np

__all__ = [
    "ERROR_BODY_CAP",
    "MAX_BODY",
    "MAX_HEAD",
    "TARGET_RE",
    "BadResponse",
    "BodyTooLarge",
    "Conn",
    "ConnectionLost",
    "Headers",
    "IncompleteBody",
    "RangeIgnored",
    "Response",
    "expire",
]

MAX_HEAD = 64 * 1024  # bytes of status line + headers
ERROR_BODY_CAP = 64 * 1024  # bytes kept of a non-2xx body; the connection closes when there is more
MAX_BODY = 1 << 30  # bytes of a 2xx body when the caller gives no bound (it always does on the hot path)
# Bytes of the per-connection receive buffer for heads, chunked and close-delimited bodies. Small on
# purpose: a Content-Length body arrives straight in its own buffer after this first read, so only
# the body bytes that share a read with the head are copied.
_READ_SIZE = 16 * 1024
_HEX_RE = re.compile(r"[0-9A-Fa-f]{1,15}")
_NO_VIEW = memoryview(b"")  # no body being received into a buffer
TARGET_RE = re.compile(r"/[^\s]*")
_VERSIONS = ("HTTP/1.1", "HTTP/1.0")
_HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE, _DONE = range(5)


class BadResponse(Exception):
    """The server's bytes are not a valid HTTP/1.x response, or not an answer to what was asked."""


class RangeIgnored(BadResponse):
    """A ranged GET was answered ``200`` (the whole object): refused at the head, body unread."""


class BodyTooLarge(BadResponse):
    """A 2xx head announced more than ``max_body`` bytes (``length``); ``headers`` are the head's,
    for the caller to tell a changed object from a lying server. Refused before any buffer."""

    def __init__(self, message: str, length: int, headers: Headers) -> None:
        super().__init__(message)
        self.length, self.headers = length, headers


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
    Content-Length in bytes, None when chunked or close-delimited). A non-2xx body is cut at 64 KiB.
    ``buffer``: a 2xx body left in the buffer it was received into, where the request asked for that
    (``body`` is then empty)."""

    __slots__ = ("body", "buffer", "content_length", "headers", "status")

    def __init__(
        self,
        status: int,
        headers: Headers,
        body: bytes,
        content_length: int | None,
        buffer: bytearray | memoryview | None = None,
    ) -> None:
        self.status, self.headers, self.body, self.content_length = status, headers, body, content_length
        self.buffer = buffer


class Conn(asyncio.BufferedProtocol):
    """One connection: parses one response at a time into ``fut``."""

    def __init__(self, pool: Any, origin: str) -> None:  # pool: H1Pool (it imports this module)
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.scratch = bytearray(_READ_SIZE)
        self.fut: asyncio.Future[Response] | None = None
        self.state = _DONE
        self.head = bytearray()
        self.body = bytearray()  # a chunked or close-delimited body
        self.view = _NO_VIEW  # a body of known length (Content-Length), received into it
        self.got = self.need = 0  # body bytes received / wanted (Content-Length mode)
        self.max_body = MAX_BODY  # the most bytes a 2xx body of the current request may have
        self.ranged = False  # the current request asked for a range: 206 expected, 200 refused
        self.as_buffer = False  # the current request takes a 2xx body as the bytearray received into
        self.extra = 0  # informational heads, then trailer bytes, of the current response
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
        except Exception as exc:  # an over-long number, a MemoryError: never an asyncio "Fatal error"
            self._fail(BadResponse(f"unreadable response ({type(exc).__name__}: {str(exc)[:80]})"))

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
    def send(
        self,
        request: bytes,
        fut: asyncio.Future[Response],
        max_body: int,
        ranged: bool,
        as_buffer: bool = False,
    ) -> None:
        """Write ``request``; its response goes to ``fut``. ``max_body``: the most bytes a 2xx body
        may have; ``ranged``: the request asked for a range (a 200 is refused, a 206 expected);
        ``as_buffer``: a 2xx body is given as the buffer it was received into (``Response.buffer``)."""
        assert self.transport is not None
        self.fut, self.state, self.got, self.extra = fut, _HEAD, 0, 0
        self.max_body, self.ranged, self.as_buffer = max_body, ranged, as_buffer
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
                if head.count(b"\n") != head.count(b"\r\n"):  # would wait for a CRLF CRLF in vain
                    raise BadResponse("a response head line ends with a bare LF")
                return
            if end > MAX_HEAD:
                raise BadResponse(f"response head over {MAX_HEAD} bytes")
            block, rest = bytes(head[:end]), bytes(head[end + 4 :])
            head.clear()
            self._start(block)
            if rest:
                self._feed(rest)
        elif state == _LENGTH:  # the body bytes that came with the head
            n = min(len(data), self.need - self.got)
            self.view[self.got : self.got + n] = data[:n]
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
            if self.status >= 300:
                if len(self.body) >= ERROR_BODY_CAP:
                    self._finish()
            elif len(self.body) > self.max_body:
                raise BadResponse(f"the body runs past the {self.max_body} bytes asked for")
        else:  # bytes nobody asked for
            self.keep_alive = False
            if self.transport is not None:
                self.transport.close()

    def _start(self, block: bytes) -> None:
        """Parse the status line and headers, check them against the request, choose how the body ends."""
        lines = block.decode("latin-1").split("\r\n")
        if block.count(b"\n") != len(lines) - 1 or block.count(b"\r") != len(lines) - 1:
            raise BadResponse("a bare CR or LF in the response head")
        parts = lines[0].split(" ", 2)
        code = parts[1] if len(parts) > 1 else ""
        if parts[0] not in _VERSIONS or len(code) != 3 or not (code.isascii() and code.isdigit()):
            raise BadResponse(f"bad status line {lines[0][:80]!r}")
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise BadResponse("unexpected protocol switch (101)")
            self.extra += 1
            if self.extra > 16:
                raise BadResponse("more than 16 informational (1xx) heads")
            return  # informational: the real head follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadResponse(f"bad header line {line[:80]!r}")
            name, value = name.lower(), value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.status, self.headers = status, headers
        ok = status < 300
        if ok and (status == 206) != self.ranged:
            if self.ranged and status == 200:
                raise RangeIgnored("the server answered a ranged GET with the whole object (200)")
            raise BadResponse(f"HTTP {status} to a GET {'with' if self.ranged else 'without'} a Range")
        tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
        self.keep_alive = "close" not in tokens if parts[0] == "HTTP/1.1" else "keep-alive" in tokens
        te, cl = headers.get("transfer-encoding"), headers.get("content-length")
        self.length = None
        if status == 204 or status == 304:
            self.length = 0
        elif te is not None:
            if te.strip().lower() != "chunked":  # gzip, identity, ...: not the bytes as stored
                raise BadResponse(f"unsupported Transfer-Encoding {te[:40]!r} (only chunked is accepted)")
            if cl is not None:  # both: chunked wins (RFC 9112), and the stream is not trusted after
                self.keep_alive = False
            self.state, self.chunk_left, self.body, self.extra = _CHUNKED, -1, bytearray(), 0
            self._chunks()
            return
        elif cl is not None:
            if not (cl.isascii() and cl.isdigit()) or len(cl) > 18:  # also refuses repeats ("3, 4")
                raise BadResponse(f"bad Content-Length {cl[:40]!r}")
            self.length = int(cl)
        else:
            self._until_close()
            return
        self.need = self.length
        if not ok:
            if self.need > ERROR_BODY_CAP:
                self.need, self.keep_alive = ERROR_BODY_CAP, False
        elif self.need > self.max_body:  # before any buffer is made
            raise BodyTooLarge(
                f"Content-Length {self.need} is more than the {self.max_body} bytes asked for",
                self.need, Headers(headers),
            )  # fmt: skip
        # Received straight into this, and every byte of it is written before it is read (_finish at
        # got == need): not zeroed first (bytearray(n) would write the whole body once more).
        self.view = np.empty(self.need, np.uint8).data
        self.state = _LENGTH
        if self.need == 0:
            self._finish()

    def _until_close(self) -> None:
        self.state, self.keep_alive, self.body = _UNTIL_CLOSE, False, bytearray()

    def _chunks(self) -> None:
        """Consume what ``head`` holds of a chunked body (``head`` is free once the head is parsed)."""
        buf, body, cap = self.head, self.body, self.max_body
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
            if "\n" in line or "\r" in line:
                raise BadResponse("a bare CR or LF in the chunked framing")
            if self.chunk_left == -2:  # trailer lines until an empty one
                self.extra += end + 2
                if self.extra > MAX_HEAD:
                    raise BadResponse(f"chunked trailer over {MAX_HEAD} bytes")
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
            if self.status < 300 and len(body) + max(self.chunk_left, 0) > cap:
                raise BadResponse(f"the chunked body runs past the {cap} bytes asked for")

    def _finish(self) -> None:
        received: bytearray | memoryview = self.body
        if self.state == _LENGTH:
            received, self.view = self.view, _NO_VIEW
        self.body = bytearray()
        self.state = _DONE
        if self.as_buffer and self.status < 300:  # the caller cuts it up: no copy of the whole here
            resp = Response(self.status, Headers(self.headers), b"", self.length, received)
        else:
            resp = Response(self.status, Headers(self.headers), bytes(received), self.length)
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(resp)


def expire(fut: asyncio.Future[None], what: str) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError(what))

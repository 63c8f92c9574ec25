"""The latency proxy's wire: one delayed direction of a connection, HTTP/1.1 framing, canned errors,
and the throttle mode's token bucket.

The proxy (:mod:`blobdata.testing.proxy`) parses what a client sends so that requests on a
keep-alive connection are counted, and faults (or throttling) hit one request, not a whole connection.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

PENDING_BYTES = 32 * 1024 * 1024  # delayed bytes per direction before reading pauses (> bandwidth x delay)

_MAX_HEAD = 64 * 1024  # a request head longer than this means the stream is not HTTP: stop parsing

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>blobdata-proxy</RequestId></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message>"
    b"<RequestId>blobdata-proxy</RequestId></Error>"
)


FaultMode = Literal["reset", "close", "status503", "status500", "stall"]
FAULT_MODES: tuple[FaultMode, ...] = ("reset", "close", "status503", "status500", "stall")


@dataclass
class _Fault:
    mode: FaultMode
    remaining: int
    method: str | None


ThrottleStyle = Literal["s3", "gcs", "azure"]
THROTTLE_STYLES: tuple[ThrottleStyle, ...] = ("s3", "gcs", "azure")

_GCS_RATE = (
    b'{"error":{"code":429,"message":"The rate of change requests to the object exceeds the rate limit. '
    b'Please reduce the rate of requests.","errors":[{"reason":"rateLimitExceeded","domain":"usageLimits"}]}}'
)
_AZ_BUSY = (
    b'<?xml version="1.0" encoding="utf-8"?>\n<Error><Code>ServerBusy</Code>'
    b"<Message>Operations per second is over the account limit.</Message></Error>"
)


@dataclass
class Throttle:
    """A store's request-rate limit: a token bucket of ``burst`` requests refilled at ``rps`` per second.

    A request that finds no token is answered at once, as the store would: S3 ``503 Slow Down``
    (code SlowDown), GCS ``429 Too Many Requests`` (rateLimitExceeded) or Azure ``503`` with
    ``x-ms-error-code: ServerBusy``; with ``Retry-After: retry_after_s`` when that is set.
    ``methods``: the methods it counts (None: every request).
    """

    rps: float
    burst: float
    style: ThrottleStyle = "s3"
    retry_after_s: float | None = None
    methods: frozenset[str] | None = None
    tokens: float = field(default=0.0, init=False)
    stamp: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not self.rps > 0:
            raise ValueError(f"throttle rps must be positive, got {self.rps!r}")
        if not self.burst >= 1:
            raise ValueError(f"throttle burst must be at least 1 request, got {self.burst!r}")
        if self.style not in THROTTLE_STYLES:
            raise ValueError(f"throttle style must be one of {THROTTLE_STYLES}, got {self.style!r}")
        if self.retry_after_s is not None and self.retry_after_s < 0:
            raise ValueError("retry_after_s must not be negative")
        self.tokens = self.burst

    @classmethod
    def of(
        cls,
        rps: float,
        burst: float | None,
        style: ThrottleStyle,
        retry_after_s: float | None,
        methods: tuple[str, ...] | None,
    ) -> Throttle:
        """A full bucket; ``burst`` defaults to a tenth of a second's worth of requests (at least 1)."""
        return cls(
            float(rps),
            float(burst) if burst is not None else max(1.0, rps / 10),
            style,
            retry_after_s,
            frozenset(m.upper() for m in methods) if methods is not None else None,
        )

    def admit(self, method: str, now: float) -> bool:
        """Whether a request of ``method`` arriving at ``now`` (seconds) gets through (takes a token)."""
        if self.methods is not None and method not in self.methods:
            return True
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rps)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def response(self, *, close: bool, head_only: bool) -> bytes:
        """The store's throttling answer (no body for a HEAD request: only its length is sent)."""
        if self.style == "gcs":
            status, reason, ctype, body, extra = 429, "Too Many Requests", "application/json", _GCS_RATE, ""
        elif self.style == "azure":
            status, reason, ctype, body = 503, "Server Busy", "application/xml", _AZ_BUSY
            extra = "x-ms-error-code: ServerBusy\r\nx-ms-request-id: blobdata-proxy\r\n"
        else:
            status, reason, ctype, body = 503, "Slow Down", "application/xml", _SLOWDOWN
            extra = "x-amz-request-id: blobdata-proxy\r\n"
        if self.retry_after_s is not None:
            extra += f"Retry-After: {self.retry_after_s:g}\r\n"
        return _answer(status, reason, ctype, body, extra, close=close, head_only=head_only)


def _answer(
    status: int, reason: str, ctype: str, body: bytes, extra: str, *, close: bool, head_only: bool
) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
        f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode("ascii") + (b"" if head_only else body)


def error_response(mode: str, *, close: bool, head_only: bool = False) -> bytes:
    """The proxy's own answer to a ``status503`` fault (S3 SlowDown) or any other (S3 InternalError)."""
    status, reason, body = (
        (503, "Slow Down", _SLOWDOWN) if mode == "status503" else (500, "Internal Server Error", _INTERNAL)
    )
    extra = "x-amz-request-id: blobdata-proxy\r\n"
    return _answer(status, reason, "application/xml", body, extra, close=close, head_only=head_only)


@dataclass
class Request:
    method: str
    target: str
    expects_continue: bool


class RequestParser:
    """Splits a client->server byte stream into request heads and body bytes.

    ``feed`` returns ``(kind, bytes, request)`` segments in stream order: ``"head"`` with its parsed
    :class:`Request`, ``"body"`` for body and chunk-framing bytes, ``"raw"`` once the stream turned
    out not to be HTTP (everything after is forwarded uncounted).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = "head"  # head | body | chunk_size | chunk_data | trailer | raw
        self._remaining = 0

    def feed(self, data: bytes) -> list[tuple[str, bytes, Request | None]]:
        out: list[tuple[str, bytes, Request | None]] = []
        if self._state == "raw":
            return [("raw", data, None)]
        self._buf += data
        while self._buf:
            if self._state == "head":
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buf) > _MAX_HEAD:
                        self._state = "raw"
                        out.append(("raw", bytes(self._buf), None))
                        self._buf.clear()
                    break
                head = bytes(self._buf[: end + 4])
                del self._buf[: end + 4]
                out.append(("head", head, self._parse_head(head)))
            elif self._state in ("body", "chunk_data"):
                n = min(self._remaining, len(self._buf))
                out.append(("body", bytes(self._buf[:n]), None))
                del self._buf[:n]
                self._remaining -= n
                if self._remaining == 0:
                    self._state = "chunk_size" if self._state == "chunk_data" else "head"
            else:  # chunk_size or trailer: one CRLF-terminated line at a time
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                line = bytes(self._buf[: end + 2])
                del self._buf[: end + 2]
                out.append(("body", line, None))
                if self._state == "chunk_size":
                    size = int(line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self._state = "trailer"
                    else:
                        self._state, self._remaining = "chunk_data", size + 2  # data + CRLF
                elif line == b"\r\n":
                    self._state = "head"
        return out

    def _parse_head(self, head: bytes) -> Request:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        method, target = (parts[0], parts[1]) if len(parts) >= 2 else (parts[0], "")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = "chunk_size"
        else:
            length = int(headers.get("content-length", "0") or "0")
            if length > 0:
                self._state, self._remaining = "body", length
        return Request(method, target, headers.get("expect", "").lower() == "100-continue")


class Shaping(Protocol):
    """What a direction reads from its proxy on every chunk (the delay may change while it runs)."""

    delay_s: float
    bandwidth_bytes_per_s: float | None
    read_pauses: int


class Direction:
    """One direction of a connection: chunks stamped with their release time, written out by one timer.

    ``push`` stamps a chunk (``None`` = end of stream) with ``now + delay`` (later under a bandwidth
    cap; never before the chunk ahead of it) and arms the timer if it is idle; ``_release`` writes every
    due chunk and re-arms for the next. The source stops reading while too many bytes wait here or
    the destination's transport buffer is full, and resumes when both drain.
    """

    def __init__(
        self,
        shaping: Shaping,
        loop: asyncio.AbstractEventLoop,
        *,
        extra_s: float,
        on_end: Callable[[], None],
    ) -> None:
        self.shaping = shaping
        self.loop = loop
        self.dst: asyncio.Transport | None = None
        self.src: asyncio.Transport | None = None
        self._chunks: deque[tuple[float, bytes | None]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._extra_s = extra_s  # added to the first chunk only (connect_delay_s)
        self._last = 0.0  # release time of the newest chunk
        self._next_free = 0.0  # bandwidth cap: when this direction may send its next byte
        self._pending = 0
        self._dst_full = False
        self._src_paused = False
        self._on_end = on_end

    def push(self, data: bytes | None) -> None:
        proxy, loop = self.shaping, self.loop
        now = loop.time()
        release = max(now + proxy.delay_s + self._extra_s, self._last)
        self._extra_s = 0.0
        if data is not None:
            bandwidth = proxy.bandwidth_bytes_per_s
            if bandwidth is not None:
                release = max(release, self._next_free)
                self._next_free = release + len(data) / bandwidth
            self._pending += len(data)
        self._last = release
        self._chunks.append((release, data))
        if self._timer is None:
            self._timer = loop.call_at(release, self._release)
        self._throttle()

    def _release(self) -> None:
        self._timer = None
        chunks, now = self._chunks, self.loop.time()
        while chunks and chunks[0][0] <= now:
            data = chunks.popleft()[1]
            if data is None:
                chunks.clear()
                self._on_end()
                return
            self._pending -= len(data)
            if self.dst is not None and not self.dst.is_closing():
                self.dst.write(data)
        if chunks:
            self._timer = self.loop.call_at(chunks[0][0], self._release)
        self._throttle()

    def dst_full(self, full: bool) -> None:
        self._dst_full = full
        self._throttle()

    def _throttle(self) -> None:
        stop = self._dst_full or self._pending > PENDING_BYTES
        src = self.src
        if src is None or stop == self._src_paused or src.is_closing():
            return
        self._src_paused = stop
        if stop:
            self.shaping.read_pauses += 1
            src.pause_reading()
        else:
            src.resume_reading()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._chunks.clear()

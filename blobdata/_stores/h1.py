"""A small asyncio HTTP/1.1 GET client for the S3 hot path: one connection pool per process and loop.

Why not aiohttp here: it spends ~0.3 ms of client CPU per 100 KB GET (request and URL objects,
stream readers, timers per phase); this client parses the response in an
:class:`asyncio.BufferedProtocol` and receives a Content-Length body straight into a pre-sized
buffer, about half of that. GCS and Azure keep aiohttp (``_http.py``).

Scope, deliberately narrow: GET without a body, no redirects, cookies or decompression (bytes
arrive as stored). Bodies by Content-Length, ``Transfer-Encoding: chunked``, or until the server
closes, each bounded by the ``max_body`` the caller gives (:mod:`.h1_protocol`). HTTP proxies
(:mod:`.network`): ``http://`` origins through a forward proxy (absolute-form requests), ``https://``
ones through a ``CONNECT`` tunnel. A failure is never retried here, not even on a reused keep-alive
connection that the server closed: blobdata's engine owns the one retry budget. Errors:

- :class:`ConnectionLost` (a ``ConnectionError``): closed or reset before a complete response head;
  ``OSError`` from connect/TLS passes through as is (``ssl.SSLError`` for a failed handshake).
- :class:`ProxyError` (a ``ConnectionError``): the proxy could not be reached or refused the tunnel.
- :class:`IncompleteBody` (a ``ConnectionError``): closed mid-body.
- :class:`BadResponse`: not HTTP/1.x, a head over 64 KiB, a body over ``max_body``, or a status that
  does not answer the request (:class:`RangeIgnored`: a ranged GET answered 200).
- ``TimeoutError``: the request's deadline (connect to last byte) passed.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections import deque
from collections.abc import Mapping
from typing import NamedTuple

from .h1_protocol import (
    ERROR_BODY_CAP,
    MAX_BODY,
    MAX_HEAD,
    TARGET_RE,
    BadResponse,
    BodyTooLarge,
    Conn,
    ConnectionLost,
    IncompleteBody,
    RangeIgnored,
    Response,
    expire,
)
from .network import Proxy, ProxySettings, redact_url

__all__ = [
    "ERROR_BODY_CAP",
    "MAX_BODY",
    "MAX_HEAD",
    "BadResponse",
    "BodyTooLarge",
    "ConnectionLost",
    "H1Pool",
    "IncompleteBody",
    "ProxyError",
    "RangeIgnored",
    "Response",
]


class ProxyError(ConnectionError):
    """The proxy could not be reached, or refused the tunnel; ``final`` when retrying cannot help
    (it answered 403 or 407: the destination is blocked or the proxy wants other credentials)."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


class _Route(NamedTuple):
    """How to reach one origin: host, port, TLS context (None: plain), proxy (None: direct), the
    request-target prefix (the origin itself through a forward proxy) and extra header lines."""

    host: str
    port: int
    ctx: ssl.SSLContext | None
    proxy: Proxy | None
    prefix: str
    extra: str


class _Tunnel(asyncio.Protocol):
    """Reads the proxy's answer to CONNECT: one response head, nothing after it."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.head: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if not self.head.done() and (end >= 0 or len(self.buf) > MAX_HEAD):
            self.head.set_result(bytes(self.buf))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.head.done():
            self.head.set_result(bytes(self.buf))


class H1Pool:
    """Keep-alive connections for one process and event loop (create and use it inside that loop).

    ``limit`` connections at most, all origins together; a request beyond it waits for a free one.
    Idle connections are reused last-in first-out and closed after ``idle_timeout`` seconds
    (default 30). ``verify`` is botocore's: True (default), False (no certificate check) or a CA
    bundle path. ``proxies`` (default: none) says which origins are reached through which proxy.
    Hold it in :class:`blobdata._stores.http.ProcessBound` so a forked child makes its own.
    """

    def __init__(
        self,
        limit: int,
        *,
        verify: bool | str = True,
        idle_timeout: float = 30.0,
        proxies: ProxySettings | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._busy = 0  # requests holding a connection slot
        self._waiters: deque[asyncio.Future[None]] = deque()  # requests waiting for a slot, FIFO
        self._idle_timeout = idle_timeout
        self._idle: dict[str, list[Conn]] = {}
        self._conns: set[Conn] = set()
        self._origins: dict[str, _Route] = {}
        self._proxies = proxies
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        self._verify = verify

    async def get(
        self,
        origin: str,
        target: str,
        headers: Mapping[str, str],
        timeout: float,
        *,
        max_body: int = MAX_BODY,
        ranged: bool = False,
        as_buffer: bool = False,
    ) -> Response:
        """GET ``target`` (path and query, already encoded) from ``origin`` (``http[s]://host[:port]``)
        with ``headers`` (Host included), within ``timeout`` seconds from now, connect to last byte.

        ``max_body``: the most bytes a 2xx body may have (a larger one is :class:`BadResponse`, no
        buffer made for it); ``ranged``: ``headers`` ask for a range, so only a 206 is a success;
        ``as_buffer``: a 2xx body is left in the buffer it was received into (``Response.buffer``,
        ``body`` empty), for a caller that copies its parts out anyway."""
        loop = self._loop
        deadline = loop.time() + timeout
        if self._closed:
            raise ConnectionError("the connection pool is closed")
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if (
            lines.count("\n") != len(headers)
            or lines.count("\r") != len(headers)
            or not TARGET_RE.fullmatch(target)
        ):
            raise ValueError("a header or the request target contains a line break or a space")
        route = self._origins.get(origin) or self._parse(origin)
        request = f"GET {route.prefix}{target} HTTP/1.1\r\n{lines}{route.extra}\r\n".encode("latin-1")
        if self._busy < self._limit and not self._waiters:
            self._busy += 1
        else:
            await self._wait_slot(deadline)
        conn: Conn | None = None
        ok = False
        try:
            conn = self._take_idle(origin)
            if conn is None:
                conn = await self._connect(origin, route, deadline)
            fut: asyncio.Future[Response] = loop.create_future()
            conn.send(request, fut, max_body, ranged, as_buffer)
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
        timer = self._loop.call_at(deadline, expire, fut, "no free connection before the deadline")
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

    def _take_idle(self, origin: str) -> Conn | None:
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

    def _put_idle(self, conn: Conn) -> None:
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

    async def _connect(self, origin: str, route: _Route, deadline: float) -> Conn:
        if len(self._conns) >= self._limit:  # an idle one for another origin: the limit is global
            stacks = [s for s in self._idle.values() if s]
            if stacks:
                victim = min(stacks, key=lambda s: s[0].idle_since).pop(0)
                victim.abort()
        # Connecting is rare (a new keep-alive connection), so a task and a closure are affordable here.
        task = self._loop.create_task(self._open(origin, route))
        expired = False

        def on_deadline() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = self._loop.call_at(deadline, on_deadline)
        try:
            conn = await task
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().abort()  # connected just as we were cancelled
            if expired:
                raise TimeoutError("no connection before the deadline") from None
            raise
        finally:
            timer.cancel()
        if self._closed:
            conn.abort()
            raise ConnectionError("the connection pool was closed")
        return conn

    async def _open(self, origin: str, route: _Route) -> Conn:
        """A new connection to ``origin``: direct, through a forward proxy, or a CONNECT tunnel."""
        loop, proxy, ctx = self._loop, route.proxy, route.ctx
        if proxy is None:
            _, conn = await loop.create_connection(
                lambda: Conn(self, origin), route.host, route.port, ssl=ctx,
                server_hostname=route.host if ctx else None,
            )  # fmt: skip
            return conn
        try:
            if ctx is None:  # http:// through a forward proxy: absolute-form requests
                _, conn = await loop.create_connection(lambda: Conn(self, origin), proxy.host, proxy.port)
                return conn
            raw, tunnel = await loop.create_connection(_Tunnel, proxy.host, proxy.port)
        except OSError as exc:
            raise ProxyError(f"cannot reach the proxy {proxy.display} ({type(exc).__name__})") from exc
        try:
            await self._tunnel(raw, tunnel, route, proxy)
            conn = Conn(self, origin)
            tls = await loop.start_tls(raw, conn, ctx, server_hostname=route.host)
        except BaseException:
            raw.abort()
            raise
        assert isinstance(tls, asyncio.Transport)
        conn.connection_made(tls)
        return conn

    @staticmethod
    async def _tunnel(raw: asyncio.BaseTransport, tunnel: _Tunnel, route: _Route, proxy: Proxy) -> None:
        """Ask ``proxy`` for a tunnel to the route's host and port; raise :class:`ProxyError` if refused."""
        assert isinstance(raw, asyncio.Transport)
        authority = f"[{route.host}]:{route.port}" if ":" in route.host else f"{route.host}:{route.port}"
        auth = f"Proxy-Authorization: {proxy.authorization}\r\n" if proxy.authorization else ""
        raw.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\n".encode("latin-1"))
        head = await tunnel.head
        end = head.find(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].decode("latin-1")[:80]
        parts = line.split(" ", 2)
        if end < 0:
            raise ProxyError(f"the proxy {proxy.display} closed or garbled its answer to CONNECT {authority}")
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].startswith("2"):
            status = parts[1] if len(parts) > 1 else "?"
            raise ProxyError(
                f"the proxy {proxy.display} refused CONNECT {authority}: {line!r}",
                final=status in ("403", "407"),
            )
        if end + 4 != len(head):
            raise ProxyError(f"the proxy {proxy.display} sent bytes after its answer to CONNECT {authority}")

    def _parse(self, origin: str) -> _Route:
        scheme, sep, hostport = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not hostport:
            raise ValueError(f"origin must be http(s)://host[:port], got {redact_url(origin)!r}")
        host, port = hostport, 443 if scheme == "https" else 80
        m = re.fullmatch(r"(\[[^\]]+\]|[^:@]+)(?::(\d+))?", hostport)
        if m is None:
            raise ValueError(f"bad host in origin {redact_url(origin)!r}")
        host = m.group(1).strip("[]")
        port = int(m.group(2)) if m.group(2) else port
        ctx = self._ssl_context() if scheme == "https" else None
        proxy = self._proxies.for_origin(scheme, host, port) if self._proxies is not None else None
        prefix = extra = ""
        if proxy is not None and ctx is None:
            prefix = origin
            if proxy.authorization:
                extra = f"Proxy-Authorization: {proxy.authorization}\r\n"
        route = self._origins[origin] = _Route(host, port, ctx, proxy, prefix, extra)
        return route

    def proxy_for(self, origin: str) -> Proxy | None:
        """The proxy requests to ``origin`` go through (None: direct)."""
        return (self._origins.get(origin) or self._parse(origin)).proxy

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            verify = self._verify
            ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._ssl = ctx
        return self._ssl

    def _lost(self, conn: Conn) -> None:
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

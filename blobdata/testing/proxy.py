"""A TCP proxy on 127.0.0.1 that adds latency, caps bandwidth, counts HTTP requests and injects faults.

Used by fault tests and by the benchmarks (``from blobdata.testing import LatencyProxy``)::

    with LatencyProxy("127.0.0.1", server_port, delay_s=0.025) as proxy:   # RTT = 50 ms
        client = make_client(endpoint_url=proxy.endpoint_url)
        ...
        assert [m for m, _ in proxy.requests].count("GET") == 3
        proxy.fail_next(2, "status503")          # the next two requests get 503 SlowDown
        proxy.corrupt_next(5)                    # the server's next five chunks arrive with a byte flipped

The proxy runs its own asyncio loop on a daemon thread, with protocol callbacks rather than streams
(the benchmarks measure CPU on a 2-core machine it shares with the client and the server, so it has to
be cheap: no task, queue or future per chunk). Each direction of each connection stamps every chunk
with ``arrival + delay_s`` and one timer releases the due chunks in order, so latency is added
without capping throughput (a chunk never waits for the one before it to be delayed). Reading stops
while a direction holds more than 32 MiB (``_wire.PENDING_BYTES``) or its destination's buffer is full.
Client->server bytes are parsed as HTTP/1.1 (request line, headers, bodies framed by Content-Length
or chunked encoding) so requests on keep-alive connections are counted one by one.

Throttle mode stands in for a store's request-rate limit (S3's 5,500 GET/s per prefix, GCS's and
Azure's account limits)::

    proxy.set_throttle(150, burst=15, style="s3")   # 150 requests/s; beyond it 503 SlowDown
    proxy.set_throttle(150, style="gcs", retry_after_s=1)   # 429, with Retry-After: 1
    proxy.set_throttle(None)                        # no limit
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from types import TracebackType

from ._ratelimit import ThrottleMode
from ._wire import (
    FAULT_MODES,
    THROTTLE_STYLES,
    Direction,
    FaultMode,
    Request,
    RequestParser,
    Throttle,
    ThrottleStyle,
    _Fault,
    error_response,
)

__all__ = ["FAULT_MODES", "THROTTLE_STYLES", "FaultMode", "LatencyProxy", "ThrottleStyle"]


_CONNECT_TIMEOUT_S = 10.0
_BACKLOG = 4096  # listen queue: capped by the kernel (net.core.somaxconn)


class _Conn:
    """One client connection, its upstream connection and the two delayed directions between them."""

    def __init__(self, proxy: LatencyProxy, client: asyncio.Transport) -> None:
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.server: asyncio.Transport | None = None  # once connected
        self.up = Direction(proxy, self.loop, extra_s=proxy.connect_delay_s, on_end=self._client_sent_all)
        self.down = Direction(proxy, self.loop, extra_s=0.0, on_end=self.finish)
        self.up.src = self.down.dst = client
        self.parser = RequestParser() if proxy.count_requests else None
        self.drop = False  # the current request is answered by the proxy: not forwarded
        self.ignore_client = False  # stalled, or answered and closing: the client's bytes go nowhere
        self.stalled = False
        self.closed = False
        self.connect_task: asyncio.Task[None] | None = None

    def _client_sent_all(self) -> None:
        server = self.server
        if server is not None and not server.is_closing() and server.can_write_eof():
            server.write_eof()  # half-close upstream, as the client did

    def finish(self) -> None:
        """Everything the server sent reached the client (or the client is to be closed): close both."""
        if self.closed:
            return
        self.closed = True
        self.up.cancel()
        self.down.cancel()
        self.client.close()  # flushes what is buffered, then FIN
        if self.server is not None:
            self.server.close()
        if self.connect_task is not None:
            self.connect_task.cancel()
        self.proxy._conns.discard(self)

    def abort(self, *, rst: bool = False) -> None:
        """Drop both connections now (``rst``: make the client see a reset rather than a FIN)."""
        if rst:
            sock = self.client.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        for transport in (self.client, self.server):
            if transport is not None:
                transport.abort()
        self.finish()

    # -- client side ------------------------------------------------------------------------------

    def client_data(self, data: bytes) -> None:
        if self.ignore_client or self.closed:
            return
        if self.parser is None:
            self.up.push(data)
            return
        for kind, chunk, req in self.parser.feed(data):
            if self.ignore_client:
                return
            if kind == "head":
                assert req is not None
                self.drop = False
                with self.proxy._lock:
                    self.proxy._requests.append((req.method, req.target))
                mode = self.proxy._take_fault(req.method)
                if mode is not None:
                    self._request_fault(mode, req)
                    if self.closed:
                        return
                    continue
                answer = self.proxy._throttle_answer(req)
                if answer is not None:
                    self._answer(answer, req)
                    continue
            if not self.drop:
                self.up.push(chunk)

    def _request_fault(self, mode: FaultMode, req: Request) -> None:
        if mode == "reset":
            self.abort(rst=True)
        elif mode == "close":
            self.finish()  # a FIN, not a RST
        elif mode == "stall":
            self.ignore_client = self.stalled = True  # never forwarded, never answered
        else:
            self._answer(
                error_response(mode, close=req.expects_continue, head_only=req.method == "HEAD"), req
            )

    def _answer(self, response: bytes, req: Request) -> None:
        """Answer ``req`` here instead of forwarding it (its body, if any, is dropped)."""
        # A client waiting on 100-continue may or may not send its body now: close after answering
        # so the stream cannot get out of step.
        self.down.push(response)
        self.drop = True
        if req.expects_continue:
            self.ignore_client = True
            self.down.push(None)

    def client_eof(self) -> None:
        if self.stalled:
            self.finish()  # a stalled request's client left
        elif not self.ignore_client:
            self.up.push(None)

    def connection_fault(self, mode: FaultMode) -> None:
        """``count_requests=False``: a fault applies to the whole connection, before any byte."""
        if mode == "reset":
            self.abort(rst=True)
        elif mode == "close":
            self.finish()
        elif mode in ("status503", "status500"):
            self.client.write(error_response(mode, close=True))
            self.finish()
        else:  # stall: hold the connection until the client leaves or the proxy stops
            self.ignore_client = self.stalled = True

    async def connect(self) -> None:
        proxy = self.proxy
        try:
            transport, _ = await asyncio.wait_for(
                self.loop.create_connection(lambda: _ServerSide(self), proxy.target_host, proxy.target_port),
                _CONNECT_TIMEOUT_S,
            )
        except (OSError, asyncio.TimeoutError):
            self.abort()
            return
        finally:
            self.connect_task = None
        if self.closed:
            transport.abort()
            return
        self.server = transport  # type: ignore[assignment]
        self.up.dst = self.server
        self.down.src = self.server
        self.client.resume_reading()  # paused until there was somewhere to send its bytes


class _ClientSide(asyncio.Protocol):
    def __init__(self, proxy: LatencyProxy) -> None:
        self.proxy = proxy
        self.conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        proxy = self.proxy
        conn = self.conn = _Conn(proxy, transport)
        proxy._conns.add(conn)
        proxy.connections_opened += 1
        if not proxy.count_requests:
            mode = proxy._take_fault(None)
            if mode is not None:
                conn.connection_fault(mode)
                return
        transport.pause_reading()
        conn.connect_task = asyncio.ensure_future(conn.connect())

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.client_data(data)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.client_eof()
        return True  # keep our sending side open: the response may still be on its way

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.abort()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.down.dst_full(True)

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.down.dst_full(False)


class _ServerSide(asyncio.Protocol):
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self.ended = False

    def data_received(self, data: bytes) -> None:
        if not self.conn.closed:
            self.conn.down.push(self.conn.proxy._corrupted(data))

    def eof_received(self) -> bool:
        self._end()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._end()  # a reset ends the stream like a FIN: the client sees it after the delay

    def _end(self) -> None:
        if not self.ended and not self.conn.closed:
            self.ended = True
            self.conn.down.push(None)  # the client is closed once everything before has reached it

    def pause_writing(self) -> None:
        self.conn.up.dst_full(True)

    def resume_writing(self) -> None:
        self.conn.up.dst_full(False)


class LatencyProxy(ThrottleMode):
    """Forward 127.0.0.1:``port`` to ``target_host:target_port`` with delay, bandwidth cap and faults.

    delay_s:                one-way delay in seconds, applied in each direction (RTT = 2 x delay_s;
                            default 0).
    bandwidth_bytes_per_s:  cap per connection and direction in bytes/s (default None: no cap),
                            like S3's per-connection throughput.
    connect_delay_s:        extra delay before the first bytes of each new connection reach the
                            server, standing in for TCP/TLS handshakes (default 0).
    count_requests:         parse HTTP and record each request in :attr:`requests` (default True);
                            with False, bytes are forwarded unparsed and faults act per connection.
    throttle_rps:           throttle mode (needs ``count_requests``): the store accepts this many
                            requests per second (a token bucket), and answers the others as a
                            throttling store does (default None: no limit). ``throttle_burst``,
                            ``throttle_style`` and ``retry_after_s`` are :meth:`set_throttle`'s.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        delay_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        connect_delay_s: float = 0.0,
        count_requests: bool = True,
        throttle_rps: float | None = None,
        throttle_burst: float | None = None,
        throttle_style: ThrottleStyle = "s3",
        retry_after_s: float | None = None,
    ) -> None:
        if delay_s < 0 or connect_delay_s < 0:
            raise ValueError("delays must not be negative")
        if bandwidth_bytes_per_s is not None and bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be positive or None")
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = delay_s
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.connect_delay_s = connect_delay_s
        self.count_requests = count_requests
        self.port = 0
        self.connections_opened = 0
        self.read_pauses = 0  # times a direction stopped reading: its destination or delay buffer was full
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str]] = []
        self._faults: list[_Fault] = []
        self._faults_triggered = 0
        self._corrupt = 0  # server chunks still to corrupt (corrupt_next)
        self.corrupted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._throttle: Throttle | None = None
        self._answers: list[tuple[float, str, bool]] = []
        if throttle_rps is not None:
            if not count_requests:
                raise ValueError("throttle mode needs count_requests=True: it answers requests one by one")
            self.set_throttle(
                throttle_rps, burst=throttle_burst, style=throttle_style, retry_after_s=retry_after_s
            )

    # ----------------------------------------------------------------------------- public API

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def delay(self) -> float:
        """Alias of ``delay_s`` (one-way seconds); may be changed while the proxy runs."""
        return self.delay_s

    @delay.setter
    def delay(self, value: float) -> None:
        if value < 0:
            raise ValueError("delay must not be negative")
        self.delay_s = value

    @property
    def requests(self) -> list[tuple[str, str]]:
        """A snapshot of the ``(method, raw path with query)`` of every request seen, faulted included."""
        with self._lock:
            return list(self._requests)

    @property
    def faults_triggered(self) -> int:
        """How many requests a fault has been applied to so far."""
        with self._lock:
            return self._faults_triggered

    def reset_counts(self) -> None:
        """Forget the requests seen so far (pending faults stay)."""
        with self._lock:
            self._requests.clear()
            self._answers.clear()
            self._faults_triggered = 0

    def fail_next(self, n: int, mode: FaultMode, *, method: str | None = None) -> None:
        """Make the next ``n`` requests (only those with ``method``, if given) fail with ``mode``.

        reset:      the client connection is reset (RST) once the request head arrived.
        close:      the client connection is closed (FIN) once the request head arrived.
        status503:  answered by the proxy with ``503 Slow Down`` and an S3 SlowDown XML body.
        status500:  answered by the proxy with ``500 Internal Server Error`` (S3 InternalError).
        stall:      never answered; the connection stays open until the client gives up.
        """
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        if n > 0:
            with self._lock:
                self._faults.append(_Fault(mode, n, method.upper() if method else None))

    def corrupt_next(self, n: int) -> None:
        """Flip the last byte of each of the next ``n`` chunks the server sends (a body, usually: the
        bytes of an answer arrive wrong, its framing intact). ``corrupted`` counts those flipped."""
        with self._lock:
            self._corrupt += max(0, n)

    def _corrupted(self, data: bytes) -> bytes:
        if not self._corrupt or not data:
            return data
        with self._lock:
            if not self._corrupt:
                return data
            self._corrupt -= 1
            self.corrupted += 1
        return data[:-1] + bytes([data[-1] ^ 0xFF])

    def clear_faults(self) -> None:
        """Drop every pending fault."""
        with self._lock:
            self._faults.clear()

    def start(self) -> LatencyProxy:
        """Start listening on a free port of 127.0.0.1 (returns self)."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        errors: list[BaseException] = []

        def _serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    # asyncio's default backlog is 100: 8 DataLoader workers opening their 64 connections
                    # at once overflowed it, and each dropped SYN cost the client a 1 s retransmit.
                    loop.create_server(lambda: _ClientSide(self), "127.0.0.1", 0, backlog=_BACKLOG)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=_serve, name=f"latency-proxy-{self.target_port}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            self._thread = None
            raise RuntimeError(f"proxy could not listen on 127.0.0.1: {errors[0]}")
        return self

    def stop(self) -> None:
        """Close the listener and every connection (within about a second). Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        self._thread = None
        self._loop = None

    def __enter__(self) -> LatencyProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------------------ internals

    def _take_fault(self, method: str | None) -> FaultMode | None:
        with self._lock:
            for fault in self._faults:
                if fault.method is None or fault.method == method:
                    fault.remaining -= 1
                    if fault.remaining <= 0:
                        self._faults.remove(fault)
                    self._faults_triggered += 1
                    return fault.mode
        return None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        # Connections accepted in the loop's last turn meet their protocol one step later: abort
        # what is there, let the loop run a step, again, so that none is left open.
        for _ in range(3):
            for conn in list(self._conns):
                conn.abort()
            await asyncio.sleep(0)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        await asyncio.sleep(0)  # let aborted transports run connection_lost before the loop closes

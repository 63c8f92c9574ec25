"""A TCP proxy on 127.0.0.1 that adds latency, caps bandwidth, counts HTTP requests and injects faults.

Used by fault tests and by the benchmarks (``from tests.support.proxy import LatencyProxy``)::

    with LatencyProxy("127.0.0.1", server_port, delay_s=0.025) as proxy:   # RTT = 50 ms
        client = make_client(endpoint_url=proxy.endpoint_url)
        ...
        assert [m for m, _ in proxy.requests].count("GET") == 3
        proxy.fail_next(2, "status503")          # the next two requests get 503 SlowDown

The proxy runs its own asyncio loop on a daemon thread. Each direction of each connection is a
reader that stamps every chunk with ``arrival + delay_s`` and a writer that releases chunks at their
stamps, so latency is added without capping throughput (a chunk never waits for the one before it
to be delayed). Client->server bytes are parsed as HTTP/1.1 (request line, headers, bodies framed by
Content-Length or chunked encoding) so requests on keep-alive connections are counted one by one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

__all__ = ["FAULT_MODES", "FaultMode", "LatencyProxy"]

FaultMode = Literal["reset", "close", "status503", "status500", "stall"]
FAULT_MODES: tuple[FaultMode, ...] = ("reset", "close", "status503", "status500", "stall")

_CHUNK = 64 * 1024  # bytes read per socket read
_QUEUE_CHUNKS = 512  # chunks in flight per direction (32 MiB): above bandwidth x delay for tests
_MAX_HEAD = 64 * 1024  # a request head longer than this means the stream is not HTTP: stop parsing
_CONNECT_TIMEOUT_S = 10.0

_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>blobdata-proxy</RequestId></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message>"
    b"<RequestId>blobdata-proxy</RequestId></Error>"
)


def _error_response(status: int, reason: str, body: bytes, *, close: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: blobdata-proxy\r\n"
        f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass
class _Request:
    method: str
    target: str
    expects_continue: bool


class _RequestParser:
    """Splits a client->server byte stream into request heads and body bytes.

    ``feed`` returns ``(kind, bytes, request)`` segments in stream order: ``"head"`` with its parsed
    :class:`_Request`, ``"body"`` for body and chunk-framing bytes, ``"raw"`` once the stream turned
    out not to be HTTP (everything after is forwarded uncounted).
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._state = "head"  # head | body | chunk_size | chunk_data | trailer | raw
        self._remaining = 0

    def feed(self, data: bytes) -> list[tuple[str, bytes, _Request | None]]:
        out: list[tuple[str, bytes, _Request | None]] = []
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

    def _parse_head(self, head: bytes) -> _Request:
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
        return _Request(method, target, headers.get("expect", "").lower() == "100-continue")


@dataclass
class _Fault:
    mode: FaultMode
    remaining: int
    method: str | None


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    to_server: asyncio.Queue[tuple[float, bytes] | None] = field(
        default_factory=lambda: asyncio.Queue(_QUEUE_CHUNKS)
    )
    to_client: asyncio.Queue[tuple[float, bytes] | None] = field(
        default_factory=lambda: asyncio.Queue(_QUEUE_CHUNKS)
    )
    done: asyncio.Event = field(default_factory=asyncio.Event)


class LatencyProxy:
    """Forward 127.0.0.1:``port`` to ``target_host:target_port`` with delay, bandwidth cap and faults.

    delay_s:                one-way delay in seconds, applied in each direction (RTT = 2 x delay_s;
                            default 0).
    bandwidth_bytes_per_s:  cap per connection and direction in bytes/s (default None: no cap),
                            like S3's per-connection throughput.
    connect_delay_s:        extra delay before the first bytes of each new connection reach the
                            server, standing in for TCP/TLS handshakes (default 0).
    count_requests:         parse HTTP and record each request in :attr:`requests` (default True);
                            with False, bytes are forwarded unparsed and faults act per connection.
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
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str]] = []
        self._faults: list[_Fault] = []
        self._faults_triggered = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()

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
                    asyncio.start_server(self._on_client, "127.0.0.1", 0, limit=_CHUNK)
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
        for conn in list(self._conns):
            self._abort(conn)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        await asyncio.sleep(0)  # let aborted transports run connection_lost before the loop closes

    def _abort(self, conn: _Conn, *, rst: bool = False) -> None:
        if rst:
            sock = conn.client.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.client.transport.abort()
        if conn.server is not None:
            conn.server.transport.abort()
        conn.done.set()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Conn(writer)
        self._conns.add(conn)
        self.connections_opened += 1
        pumps: list[asyncio.Task[None]] = []
        try:
            if not self.count_requests:
                mode = self._take_fault(None)
                if mode is not None:
                    await self._apply_connection_fault(conn, mode)
                    return
            try:
                sreader, swriter = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port, limit=_CHUNK),
                    _CONNECT_TIMEOUT_S,
                )
            except (OSError, asyncio.TimeoutError):
                self._abort(conn)
                return
            conn.server = swriter
            pumps = [
                asyncio.ensure_future(self._read_client(reader, conn)),
                asyncio.ensure_future(self._write(conn.to_server, swriter, conn, first_extra=True)),
                asyncio.ensure_future(self._read_server(sreader, conn)),
                asyncio.ensure_future(self._write(conn.to_client, conn.client, conn, first_extra=False)),
            ]
            await conn.done.wait()
        except asyncio.CancelledError:
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            if pumps:
                await asyncio.wait(pumps, timeout=1.0)
            self._abort(conn)
            self._conns.discard(conn)
            self._tasks.discard(task)

    async def _apply_connection_fault(self, conn: _Conn, mode: FaultMode) -> None:
        if mode == "reset":
            self._abort(conn, rst=True)
        elif mode == "close":
            conn.client.close()
        elif mode in ("status503", "status500"):
            body = _SLOWDOWN if mode == "status503" else _INTERNAL
            reason = "Slow Down" if mode == "status503" else "Internal Server Error"
            conn.client.write(_error_response(503 if mode == "status503" else 500, reason, body, close=True))
            with contextlib.suppress(OSError):
                await conn.client.drain()
            conn.client.close()
        else:  # stall: hold the connection until the client leaves or the proxy stops
            await conn.done.wait()

    async def _read_client(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        parser = _RequestParser() if self.count_requests else None
        drop = False  # the current request is answered by the proxy (or stalled): not forwarded
        stalled = False
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                now = time.monotonic()
                if parser is None:
                    await conn.to_server.put((now + self.delay_s, data))
                    continue
                for kind, chunk, req in parser.feed(data):
                    if stalled:
                        continue
                    if kind == "head":
                        assert req is not None
                        with self._lock:
                            self._requests.append((req.method, req.target))
                        mode = self._take_fault(req.method)
                        drop = mode is not None
                        if mode == "reset":
                            self._abort(conn, rst=True)
                            return
                        if mode == "close":
                            conn.client.close()  # a FIN, not a RST
                            conn.done.set()
                            return
                        if mode == "stall":
                            stalled = True
                            continue
                        if mode is not None:
                            status, reason, body = (
                                (503, "Slow Down", _SLOWDOWN)
                                if mode == "status503"
                                else (500, "Internal Server Error", _INTERNAL)
                            )
                            # A client waiting on 100-continue may or may not send its body now:
                            # close after answering so the stream cannot get out of step.
                            response = _error_response(status, reason, body, close=req.expects_continue)
                            await conn.to_client.put((now + self.delay_s, response))
                            if req.expects_continue:
                                await conn.to_client.put(None)
                                return
                            continue
                    if not drop:
                        await conn.to_server.put((now + self.delay_s, chunk))
            if not stalled:
                await conn.to_server.put(None)  # client finished sending: half-close upstream
            else:
                conn.done.set()
        except (ConnectionError, OSError):
            conn.done.set()

    async def _read_server(self, reader: asyncio.StreamReader, conn: _Conn) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await conn.to_client.put((time.monotonic() + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        await conn.to_client.put(None)

    async def _write(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
        conn: _Conn,
        *,
        first_extra: bool,
    ) -> None:
        extra = self.connect_delay_s if first_extra else 0.0
        next_free = 0.0  # bandwidth: when this direction may send its next byte
        try:
            while True:
                item = await queue.get()
                if item is None:
                    if writer is conn.client:
                        conn.done.set()  # server finished and everything reached the client
                    elif writer.can_write_eof():
                        writer.write_eof()
                    return
                release, data = item
                release, extra = release + extra, 0.0
                if self.bandwidth_bytes_per_s is not None:
                    release = max(release, next_free)
                    next_free = max(release, time.monotonic()) + len(data) / self.bandwidth_bytes_per_s
                wait = release - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            conn.done.set()

"""The peer service's HTTP/1.1 server: one asyncio protocol per connection, GET requests only.

Nothing a client sends decides how much memory a connection takes: a request head is refused past
:data:`MAX_HEAD` bytes (431), a request with a body (``Content-Length`` other than 0, any
``Transfer-Encoding``), a line with a bare CR or LF, a repeated header or a method other than GET is
refused (400, 405) and the connection closed, as after any answer but 200 and 503. One request at a
time per connection, as the asking side sends them (bytes that arrive meanwhile wait, bounded as a head
is); the next is read once the answer is written and the socket's buffer has drained. At most
``max_connections`` connections at once. A connection that does not send a whole head within
:data:`HEAD_TIMEOUT_S` of its start or of the head's first byte is closed; at the limit, the one that
has waited longest without a whole head is closed for a new one, and only where every connection has
asked is the new one closed at accept. A head that is not a job member's is refused and its connection
closed, so whoever can reach the port and opens connections without asking keeps no job member's
connection out. What the answer says is the handler's (:mod:`.service`).

Every process of every other node may hold connections to a node's service (a job of 16 nodes of 8
ranks and 8 workers: over a thousand), more than the 1,024 files a process may open by default. A
server that starts raises its process's soft limit on open files toward the hard one, for its
connections and as many again for the process's other files (:func:`room_for`), and takes no more
connections than that limit leaves room for. Past that room a connection is closed as above (where
every connection has asked, the new one at once, and its asker reads from the bucket); past the limit
itself, accept would fail (EMFILE) and the connections beyond would wait in the listener's backlog.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import resource
from collections.abc import Awaitable, Callable
from typing import NamedTuple

__all__ = ["HEAD_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_HEAD", "Reply", "Request", "Server", "plain", "room_for"]

_log = logging.getLogger("blobdata")

#: Connections a node's service holds at most (each a few KB while idle).
MAX_CONNECTIONS = 8192
#: Fewer connections than this, for want of open files, are worth a warning.
_WARN_BELOW = 1024

MAX_HEAD = 16 * 1024  # bytes of a request line and headers
#: Seconds a request head may take to arrive: from a connection's start to its first head, and from a
#: head's first byte to its last. The asking side sends each head whole, in one write; a connection
#: that holds one of the service's slots without asking (anyone who can reach the port) is closed. A
#: connection idle between answers stays: it asked and was answered (a refusal closes it), so it is a
#: job member's, whose pool reuses it.
HEAD_TIMEOUT_S = 10.0
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_REASONS = {
    200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    421: "Misdirected Request", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    502: "Bad Gateway", 503: "Service Unavailable",
}  # fmt: skip


class Request(NamedTuple):
    """One request: method, target (path and query, as sent), headers by lower-case name."""

    method: str
    target: str
    headers: dict[str, str]


class Reply(NamedTuple):
    """One answer: status, headers (Content-Length is added), and its body's parts, one after the other
    (an answer of many objects is joined once, with its head, when it is sent)."""

    status: int
    headers: dict[str, str]
    body: tuple[bytes, ...]


Handler = Callable[[Request], Awaitable[Reply]]


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def parse_head(head: bytes) -> Request:
    """The request in ``head`` (without its closing blank line); :class:`_BadRequest` if invalid."""
    text = head.decode("latin-1")
    lines = text.split("\r\n")
    if any("\r" in line or "\n" in line for line in lines):
        raise _BadRequest(400, "a bare CR or LF in the request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not _TARGET.fullmatch(parts[1]):
        raise _BadRequest(400, "not an HTTP/1.1 request line")
    if parts[0] != "GET":
        raise _BadRequest(405, "only GET is served")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise _BadRequest(400, "a malformed header line")
        key = name.lower()
        if key in headers:
            raise _BadRequest(400, f"header {name} given twice")
        headers[key] = value.strip(" \t")
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise _BadRequest(400, "a GET with a body")
    return Request(parts[0], parts[1], headers)


def render(reply: Reply, *, close: bool) -> bytes:
    """The head of ``reply`` (its body goes after it)."""
    lines = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Unknown')}"]
    lines += [f"{k}: {v}" for k, v in reply.headers.items()]
    lines.append(f"Content-Length: {sum(len(part) for part in reply.body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def plain(status: int, reason: str) -> Reply:
    """A short text answer (a refusal, an error)."""
    return Reply(status, {"Content-Type": "text/plain; charset=utf-8"}, (reason.encode("utf-8", "replace"),))


class _Conn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.paused = False  # the socket's send buffer is full: read no further request
        self.timer: asyncio.TimerHandle | None = None  # a head is awaited: HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        server = self.server
        if len(server.conns) >= server.max_connections:
            if not server.unasked:  # every connection has asked: each is answered, then kept or closed
                transport.abort()
                return
            # Full: the connection that has waited longest without asking makes room (a job member's
            # asks at once, so the connections of whoever opens many and asks nothing go first).
            oldest = next(iter(server.unasked))
            server.conns.discard(oldest)
            server.unasked.pop(oldest, None)
            oldest._close(abort=True)
        server.conns.add(self)
        server.unasked[self] = None
        self._await_head()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None and not self.paused:
            self._next()
        elif len(self.buf) > MAX_HEAD:  # more than a request while one is answered: not our client
            self._close(abort=True)

    def _await_head(self) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.server.head_timeout, self._too_slow)

    def _too_slow(self) -> None:  # (a whole head cancels the timer: no request is answered here)
        self.timer = None
        self._close(abort=True)

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                self._answer(plain(431, "request head too large"), close=True)
            elif self.buf:  # a head begun: it has HEAD_TIMEOUT_S to end
                self._await_head()
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.server.unasked.pop(self, None)
        if end > MAX_HEAD:
            self._answer(plain(431, "request head too large"), close=True)
            return
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        try:
            req = parse_head(head)
        except _BadRequest as exc:
            self._answer(plain(exc.status, str(exc)), close=True)
            return
        close = req.headers.get("connection", "").lower() == "close"
        self.task = asyncio.get_running_loop().create_task(self._handle(req, close))

    async def _handle(self, req: Request, close: bool) -> None:
        try:
            reply = await self.server.handler(req)
        except Exception as exc:  # the handler's own failure: an answer all the same
            reply = plain(500, f"{type(exc).__name__}")
        self.task = None
        # A refusal ends the connection (a stranger keeps none open); busy (503) is a moment's.
        self._answer(reply, close=close or reply.status not in (200, 503))

    def _answer(self, reply: Reply, *, close: bool) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        # Head and body in one write: one send for an answer, not a head a reader may see alone (and
        # one copy of the objects: asyncio's writelines joins what it is given before it sends).
        t.write(b"".join((render(reply, close=close), *reply.body)))
        if close:
            self._close()
        elif self.buf and not self.paused:
            self._next()

    def _close(self, *, abort: bool = False) -> None:
        t = self.transport
        if t is not None:
            t.abort() if abort else t.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.task is None and self.buf:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.conns.discard(self)
        self.server.unasked.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.transport = None


def room_for(connections: int) -> int:
    """How many connections this process can hold, once its soft limit on open files is raised (toward
    the hard limit, never lowered) to ``connections`` plus as many again, at least 1,024, for its other
    files (a training process's cache, bucket connections, DataLoader pipes, shared tensors): the
    limit less that reserve; where the hard limit is lower than that, half of what the files open now
    leave. A warning says so where that is fewer than 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reserve = max(1024, connections)
    want = connections + reserve
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard) and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            _log.debug("blobdata: open files limit raised from %d to %d for the peer service", soft, new)
            soft = new
        except (ValueError, OSError):  # not allowed here: the limit stays
            pass
    if soft == resource.RLIM_INFINITY:
        return connections
    # What the reserve leaves, and where that is nothing, half of what the files open now leave.
    room = min(connections, max(soft - reserve, (soft - _open_files()) // 2, 0))
    if room < connections:  # said where it would hold back a job of a dozen nodes or so
        (_log.warning if room < min(connections, _WARN_BELOW) else _log.debug)(
            "blobdata: this process may open only %d files (ulimit -n; hard limit %s), so its peer "
            "service holds at most %d connections; a job of many nodes wants more: raise the hard limit "
            "(ulimit -Hn, or LimitNOFILE in a systemd unit)", soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard, room,
        )  # fmt: skip
    return room


def _open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        return 0


class Server:
    """Serves ``handler``'s answers on ``host``:``port`` (0: a free port) of the running loop."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT_S,
    ) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.conns: set[_Conn] = set()
        #: The connections that have not sent a whole head yet, oldest first: at the limit, the first goes.
        self.unasked: dict[_Conn, None] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listen; returns the port."""
        loop = asyncio.get_running_loop()
        self.max_connections = room_for(self.max_connections)
        # asyncio accepts up to `backlog` connections in one go, before the ones refused are closed: a
        # fraction of the room, lest a burst past it make accept fail (EMFILE) and stall the listener.
        backlog = min(1024, max(16, self.max_connections // 4))
        self._server = await loop.create_server(lambda: _Conn(self), host, port, backlog=backlog)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def aclose(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.conns):
            conn._close(abort=True)

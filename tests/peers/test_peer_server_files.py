"""A node's peer service holds a connection from every process of every other node: more than the
1,024 files a process may open by default in a job of a few dozen nodes. The server raises its
process's soft limit toward the hard one, and where the hard limit leaves no room, it takes what fits
and refuses the rest at once, without a failed accept (EMFILE) stalling its listener. Real processes,
each with its own limits, and real sockets."""

from __future__ import annotations

import resource
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)

CONNECTIONS = 400
LOW = 128  # the child's soft limit: too few files for CONNECTIONS connections

#: A service alone in its process, under the limits argv gives it: it prints its port, its soft limit
#: then and how many connections it takes, then the connections it holds for each line it reads.
CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
from blobdata._loop import run
from blobdata._peers.server import Server, plain
async def handler(req):
    return plain(200, "ok")
server = Server(handler, head_timeout=600)  # the test's connections wait long before they ask
port = run(server.start("127.0.0.1", 0))
print(port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], server.max_connections, flush=True)
for _ in sys.stdin:
    print(len(server.conns), flush=True)
"""


class Child:
    def __init__(self, soft: int, hard: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(soft), str(hard)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.err: list[str] = []
        assert self.proc.stderr is not None and self.proc.stdout is not None
        self.reader = threading.Thread(target=self.err.extend, args=(self.proc.stderr,), daemon=True)
        self.reader.start()
        port, self.soft, self.room = (int(x) for x in self.proc.stdout.readline().split())
        self.port = port

    def held(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def stop(self) -> str:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.reader.join(timeout=10)  # it has read to the end of the child's stderr
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return "".join(self.err)


def _connect(port: int, n: int) -> list[socket.socket]:
    # A full listen queue drops a SYN, and the kernel sends it again 1, 2, 4 s later: 30 s covers it.
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(n)]


def _answered(sock: socket.socket, deadline: float) -> bool:
    sock.settimeout(max(0.05, deadline - time.monotonic()))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock.recv(64).startswith(b"HTTP/1.1 200")


def _closed(socks: list[socket.socket]) -> list[socket.socket]:
    """Those of ``socks`` the other side closed (or reset), waited for up to 10 s; the others are
    open and have nothing to read."""
    closed: list[socket.socket] = []
    rest, deadline = list(socks), time.monotonic() + 10
    while rest and time.monotonic() < deadline:
        readable, _, _ = select.select(rest, [], [], 1.0)
        if not readable:
            break
        for s in readable:
            try:
                got = s.recv(64)
            except ConnectionResetError:
                got = b""
            assert got == b"", got  # nothing is said before a request
            closed.append(s)
            rest.remove(s)
    return closed


def _hard() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(
    _hard() != resource.RLIM_INFINITY and _hard() < 4 * CONNECTIONS, reason="a low hard limit on open files"
)
def test_a_service_raises_its_soft_limit_and_holds_every_connection() -> None:
    child = Child(LOW, _hard())
    socks: list[Any] = []
    try:
        assert child.soft > LOW and child.room >= CONNECTIONS
        socks = _connect(child.port, CONNECTIONS)
        deadline = time.monotonic() + 30
        assert all(_answered(s, deadline) for s in socks)  # each one accepted and served
        assert child.held() == CONNECTIONS
    finally:
        for s in socks:
            s.close()
        err = child.stop()
    assert "out of system resource" not in err and "ulimit" not in err, err[-2000:]


def test_under_a_low_hard_limit_it_holds_what_fits_and_refuses_the_rest_at_once() -> None:
    child = Child(LOW, LOW)
    socks: list[Any] = []
    try:
        assert child.soft == LOW and 0 < child.room < LOW // 2 + 1
        socks = _connect(child.port, CONNECTIONS)
        refused = _closed(socks)
        kept = [s for s in socks if s not in refused]
        assert len(kept) == child.room and len(refused) == CONNECTIONS - child.room
        assert child.held() == child.room
        deadline = time.monotonic() + 30
        assert all(_answered(s, deadline) for s in kept)  # the listener was never stalled
    finally:
        for s in socks:
            s.close()
        err = child.stop()
    assert "out of system resource" not in err, err[-2000:]  # no failed accept
    assert f"may open only {LOW} files" in err and "ulimit -Hn" in err  # said once, with what to do
    assert err.count("may open only") == 1

"""The asking side never takes a wrong byte and never fails a read because of a peer: an impostor on a
peer's address (no secret) is refused however right its bytes look, a peer that refuses, is gone or
stalls is bypassed for the bucket, and one that is slow is hedged. Real servers on loopback ports."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest

from blobdata._loop import run
from blobdata._metrics import stats as _stats
from blobdata._peers import PeerClient, PeerTable
from blobdata._peers.service import crc_text

pytestmark = pytest.mark.timeout(60)

SECRET = os.urandom(32)
URL, IDENT = "s3://bucket/train/c/x.jpg", '"etag-1"'
REAL = b"the object's own bytes" * 100


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Answers as a peer would, but without the job's secret: the bytes of its choice, their true CRC,
    the identity asked for, a made-up signature; or ``status``, or nothing for ``delay_s``."""

    body = b"x" * len(REAL)
    status = 200
    delay_s = 0.0
    asked = 0

    def do_GET(self) -> None:
        type(self).asked += 1
        time.sleep(self.delay_s)
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("X-Blobdata-Identity", quote(IDENT, safe=""))
        self.send_header("X-Blobdata-Crc", crc_text(self.body))
        self.send_header("X-Blobdata-From", "cache")
        self.send_header("X-Blobdata-Signature", "0" * 64)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def impostor() -> Iterator[tuple[type[_Impostor], int]]:
    handler = type("Impostor", (_Impostor,), {"asked": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _client(port: int) -> PeerClient:
    return PeerClient(PeerTable(SECRET, ("me", "peer"), ("127.0.0.1:9", f"127.0.0.1:{port}"), 0))


class _Bucket:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.reads = 0
        self.delay_s = delay_s

    async def __call__(self) -> tuple[bytes, str]:
        import asyncio

        self.reads += 1
        await asyncio.sleep(self.delay_s)
        return REAL, IDENT


def _slots(*names: str) -> list[float]:
    v = _stats.rec()
    return [v[getattr(_stats, n)] for n in names]


def _read(client: PeerClient, bucket: _Bucket) -> tuple[bytes, bool]:
    return run(client.read(1, URL, len(REAL), IDENT, bucket), 30)


def test_an_impostor_on_a_peers_address_is_refused_however_right_its_bytes_look(
    impostor: tuple[type[_Impostor], int],
) -> None:
    handler, port = impostor
    client, bucket = _client(port), _Bucket()
    wrong0, fallback0 = _slots("PEER_WRONG", "PEER_FALLBACK")
    assert _read(client, bucket) == (REAL, False)
    assert handler.asked == 1 and bucket.reads == 1
    wrong1, fallback1 = _slots("PEER_WRONG", "PEER_FALLBACK")
    assert (wrong1 - wrong0, fallback1 - fallback0) == (1, 1)
    assert _read(client, bucket) == (REAL, False)  # the peer is left alone for a while: not asked
    assert handler.asked == 1 and bucket.reads == 2
    # Even its bytes being the object's own would not do: the answer is not signed by the job.
    handler.body = REAL
    client2 = _client(port)
    assert _read(client2, bucket) == (REAL, False) and handler.asked == 2 and bucket.reads == 3


def test_a_peer_that_refuses_is_bypassed(impostor: tuple[type[_Impostor], int]) -> None:
    handler, port = impostor
    handler.status, handler.body = 403, b"no"
    client, bucket = _client(port), _Bucket()
    assert _read(client, bucket) == (REAL, False) and handler.asked == 1
    assert _read(client, bucket) == (REAL, False) and handler.asked == 1 and bucket.reads == 2


def test_a_peer_that_is_gone_costs_a_bucket_read() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    client, bucket = _client(port), _Bucket()
    fallback0 = _slots("PEER_FALLBACK")[0]
    assert _read(client, bucket) == (REAL, False) and bucket.reads == 1
    assert _slots("PEER_FALLBACK")[0] - fallback0 == 1


def test_a_slow_peer_is_hedged_and_a_stalled_one_given_up(impostor: tuple[type[_Impostor], int]) -> None:
    handler, port = impostor
    handler.delay_s = 8.0  # far beyond the hedge's wait (1 s before anything was timed)
    client, bucket = _client(port), _Bucket()
    hedged0 = _slots("PEER_HEDGED")[0]
    t = time.monotonic()
    assert _read(client, bucket) == (REAL, False)
    assert time.monotonic() - t < handler.delay_s  # the bucket's answer was taken, not waited past
    assert _slots("PEER_HEDGED")[0] - hedged0 == 1 and bucket.reads == 1
    # With no hedge left to spend, the read waits for the peer up to its deadline, then gives it up.
    client._tokens = 0.0
    assert _read(client, bucket) == (REAL, False) and bucket.reads == 2
    assert _slots("PEER_HEDGED")[0] - hedged0 == 1
    asked = handler.asked
    assert _read(client, bucket) == (REAL, False) and handler.asked == asked  # given up: not asked

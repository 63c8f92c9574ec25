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
    """Answers as a peer would, but without the job's secret: the bytes of its choice, a table with
    their true length and CRC, a made-up signature; or ``status``, or nothing for ``delay_s``."""

    body = b"x" * len(REAL)
    status = 200
    delay_s = 0.0
    asked = 0

    def do_GET(self) -> None:
        type(self).asked += 1
        time.sleep(self.delay_s)
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("X-Blobdata-Table", f"c{len(self.body)}.{crc_text(self.body)}")
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


#: Both ways a read is made: awaited in a task of its own (``read``), or started as one of a batch
#: without one (``start``: the look-ahead's misses), which reads a peer given up for now as ``read``.
WAYS = ("read", "start")


async def _one(client: PeerClient, bucket: _Bucket, way: str) -> tuple[bytes, bool]:
    if way == "read":
        return await client.read(1, URL, len(REAL), IDENT, bucket)
    fut = client.start(1, URL, len(REAL), IDENT, bucket)
    if fut is None:  # the peer is given up for now: read as the dataset then reads it
        return await client.read(1, URL, len(REAL), IDENT, bucket)
    peer0 = _slots("FROM_PEER")[0]
    data = await fut
    return data, _slots("FROM_PEER")[0] > peer0


def _read(client: PeerClient, bucket: _Bucket, way: str = "read") -> tuple[bytes, bool]:
    return run(_one(client, bucket, way), 30)


@pytest.mark.parametrize("way", WAYS)
def test_an_impostor_on_a_peers_address_is_refused_however_right_its_bytes_look(
    impostor: tuple[type[_Impostor], int], way: str
) -> None:
    handler, port = impostor
    client, bucket = _client(port), _Bucket()
    wrong0, fallback0 = _slots("PEER_WRONG", "PEER_FALLBACK")
    assert _read(client, bucket, way) == (REAL, False)
    assert handler.asked == 1 and bucket.reads == 1
    wrong1, fallback1 = _slots("PEER_WRONG", "PEER_FALLBACK")
    assert (wrong1 - wrong0, fallback1 - fallback0) == (1, 1)
    assert _read(client, bucket, way) == (REAL, False)  # the peer is left alone for a while: not asked
    assert handler.asked == 1 and bucket.reads == 2
    # Even its bytes being the object's own would not do: the answer is not signed by the job.
    handler.body = REAL
    client2 = _client(port)
    assert _read(client2, bucket, way) == (REAL, False) and handler.asked == 2 and bucket.reads == 3


@pytest.mark.parametrize("way", WAYS)
def test_a_peer_that_refuses_is_bypassed(impostor: tuple[type[_Impostor], int], way: str) -> None:
    handler, port = impostor
    handler.status, handler.body = 403, b"no"
    client, bucket = _client(port), _Bucket()
    assert _read(client, bucket, way) == (REAL, False) and handler.asked == 1
    assert _read(client, bucket, way) == (REAL, False) and handler.asked == 1 and bucket.reads == 2


@pytest.mark.parametrize("way", WAYS)
def test_a_peer_that_is_gone_costs_a_bucket_read(way: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    client, bucket = _client(port), _Bucket()
    fallback0 = _slots("PEER_FALLBACK")[0]
    assert _read(client, bucket, way) == (REAL, False) and bucket.reads == 1
    assert _slots("PEER_FALLBACK")[0] - fallback0 == 1


@pytest.mark.parametrize("way", WAYS)
def test_a_slow_peer_is_hedged_and_a_stalled_one_given_up(
    impostor: tuple[type[_Impostor], int], way: str
) -> None:
    handler, port = impostor
    handler.delay_s = 8.0  # far beyond the hedge's wait (1 s before anything was timed)
    client, bucket = _client(port), _Bucket()
    hedged0 = _slots("PEER_HEDGED")[0]
    t = time.monotonic()
    assert _read(client, bucket, way) == (REAL, False)
    assert time.monotonic() - t < handler.delay_s  # the bucket's answer was taken, not waited past
    assert _slots("PEER_HEDGED")[0] - hedged0 == 1 and bucket.reads == 1
    # With no hedge left to spend, the read waits for the peer up to its deadline, then gives it up.
    client._tokens = 0.0
    assert _read(client, bucket, way) == (REAL, False) and bucket.reads == 2
    assert _slots("PEER_HEDGED")[0] - hedged0 == 1
    asked = handler.asked
    assert _read(client, bucket, way) == (REAL, False) and handler.asked == asked  # given up: not asked


@pytest.mark.parametrize("way", WAYS)
def test_reads_of_one_slow_request_spend_the_hedge_budget_one_each_the_rest_wait_to_the_deadline(
    impostor: tuple[type[_Impostor], int], way: str
) -> None:
    import asyncio

    handler, port = impostor
    handler.delay_s = 20.0  # far beyond the first hedge's wait (1 s) and the deadline (5 s)
    client, bucket = _client(port), _Bucket()
    client._tokens = 2.0  # two hedges to spend, three reads in the one request
    hedged0, fallback0 = _slots("PEER_HEDGED", "PEER_FALLBACK")

    async def three() -> list[tuple[bytes, bool]]:
        return await asyncio.gather(*(_one(client, bucket, way) for _ in range(3)))

    t = time.monotonic()
    assert run(three(), 30) == [(REAL, False)] * 3
    took = time.monotonic() - t
    assert handler.asked == 1  # one request for the three
    assert _slots("PEER_HEDGED")[0] - hedged0 == 2 and bucket.reads == 3
    assert _slots("PEER_FALLBACK")[0] - fallback0 == 3
    assert 4.0 < took < handler.delay_s  # the third read waited to the deadline, not to the answer
    assert client._peers[1].down_until > time.monotonic()  # the peer is given up for a while


def test_a_started_read_left_by_its_reader_stops_its_bucket_read_and_a_bucket_error_is_its_own(
    impostor: tuple[type[_Impostor], int],
) -> None:
    """A read started without a task (the look-ahead's) whose future is cancelled (the epoch's order
    changed) while it races the bucket stops the bucket's read too; where the peer has nothing and the
    bucket fails, the future holds the bucket's own error, as a read in a task of its own would raise."""
    import asyncio

    from blobdata._errors import BlobdataError

    handler, port = impostor
    handler.delay_s = 20.0  # past the first hedge's wait (1 s): the read races the bucket
    client = _client(port)

    class _Stuck(_Bucket):
        cancelled = False

        async def __call__(self) -> tuple[bytes, str]:
            self.reads += 1
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
            return REAL, IDENT

    stuck = _Stuck()

    async def leave() -> None:
        fut = client.start(1, URL, len(REAL), IDENT, stuck)
        assert fut is not None
        while not stuck.reads:  # hedged: the bucket is asked too
            await asyncio.sleep(0.05)
        fut.cancel()
        for _ in range(100):
            if stuck.cancelled:
                break
            await asyncio.sleep(0.01)

    run(leave(), 30)
    assert stuck.reads == 1 and stuck.cancelled and not client._rests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]

    async def failing() -> tuple[bytes, str]:
        raise BlobdataError(f"{URL}: the bucket is down too")

    async def fails() -> BaseException | None:
        fut = _client(gone).start(1, URL, len(REAL), IDENT, failing)
        assert fut is not None
        try:
            await fut
        except BlobdataError as exc:
            return exc
        return None

    got = run(fails(), 30)
    assert isinstance(got, BlobdataError) and "the bucket is down too" in str(got)


def test_an_answer_whose_table_does_not_match_its_bytes_or_the_request_is_refused() -> None:
    """What a signed answer's table says is checked against the bytes and what was asked: a peer with
    the secret but a bug (or bytes changed on the way) gives no wrong byte either."""
    from blobdata._peers.client import _split

    one, two = b"a" * 10, b"b" * 7
    good = f"c10.{crc_text(one)} b7.{crc_text(two)}"
    assert _split(good, one + two, [10, 7]) == ([one, two], True)
    parts, _ = _split(good, bytearray(one + two), [10, 7])  # the buffer it was received into
    assert parts == [one, two] and all(type(p) is bytes for p in parts or [])
    assert _split(f"c10.{crc_text(one)} -", one, [10, 7]) == ([one, None], False)
    wrong = {
        "one entry short": (f"c10.{crc_text(one)}", one + two, [10, 7]),
        "one entry more": (good + " -", one + two, [10, 7]),
        "a length other than asked": (
            f"c10.{crc_text(one)} b8.{crc_text(two + b'b')}",
            one + two + b"b",
            [10, 7],
        ),
        "bytes beyond the table": (good, one + two + b"x", [10, 7]),
        "bytes short": (good, one + two[:-1], [10, 7]),
        "swapped bytes": (good, two + one, [10, 7]),
        "a changed byte": (good, one + b"c" + two[1:], [10, 7]),
        "an unknown origin": (f"x10.{crc_text(one)} b7.{crc_text(two)}", one + two, [10, 7]),
        "no checksum": ("c10 b7", one + two, [10, 7]),
        "a length with a sign": (f"c+10.{crc_text(one)} b7.{crc_text(two)}", one + two, [10, 7]),
    }
    for why, (table, body, sizes) in wrong.items():
        assert _split(table, body, sizes) == (None, False), why


def test_a_requests_fields_are_quoted_as_urllib_quotes_them() -> None:
    """The client's own quoting of a URL and an identity gives urllib's ``quote(text, safe="/:")``
    exactly (the oracle), for every ASCII character alone and in random texts, and for text beyond
    ASCII; the service's ``unquote`` gives the text back."""
    import random
    from urllib.parse import quote, unquote

    from blobdata._peers.client import _quoted

    rng = random.Random(7)
    alphabet = [chr(c) for c in range(128)] + ["é", "日", "\U0001f600"]
    texts = [chr(c) for c in range(128)] + [URL, IDENT, "", "s3://b/a b/100%.jpg", 'W/"x"', "%2F&e=1"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))) for _ in range(2000)]
    for text in texts:
        got = _quoted(text)
        assert got == quote(text, safe="/:"), text
        assert unquote(got, errors="strict") == text

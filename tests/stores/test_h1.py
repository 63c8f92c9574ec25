"""The HTTP/1.1 client of the S3 hot path (blobdata._stores.h1), against real sockets only.

Most tests run a small scripted asyncio server on 127.0.0.1 in the test's own loop: each request
gets a reply chosen by ``(connection number, request number on it)``, and the server counts the
connections it accepted and how many were open at once. The S3 tests use the session S3 server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from blobdata._errors import TransientError
from blobdata._stores.h1 import ERROR_BODY_CAP, BadResponse, ConnectionLost, H1Pool, IncompleteBody
from blobdata._stores.http import ProcessBound
from blobdata._stores.s3 import S3Reader
from tests.support import wait_child

pytestmark = pytest.mark.timeout(30)

#: What the server does after writing a reply: keep the connection, close it, or go silent.
Then = str
Reply = tuple[list[bytes], Then]


@dataclass
class Stats:
    connections: int = 0
    requests: int = 0
    open: int = 0
    max_open: int = 0


def ok(body: bytes, *extra: str, version: str = "1.1") -> list[bytes]:
    head = f"HTTP/{version} 200 OK\r\nContent-Length: {len(body)}\r\nX-Test: yes\r\n"
    return [(head + "".join(e + "\r\n" for e in extra) + "\r\n").encode() + body]


@contextlib.asynccontextmanager
async def serve(
    reply: Callable[[int, int], Reply], *, delay: float = 0.0, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[str, Stats]]:
    """Yield (origin, stats). Reply pieces are written with a short pause between them; with ``tls``
    the origin is ``https://localhost:port``."""
    stats = Stats()
    handlers: set[asyncio.Task[Any]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.add(writer)
        conn_no = stats.connections
        stats.connections += 1
        stats.open += 1
        stats.max_open = max(stats.max_open, stats.open)
        try:
            for req_no in range(1000):
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                stats.requests += 1
                await asyncio.sleep(delay)
                pieces, then = reply(conn_no, req_no)
                for i, piece in enumerate(pieces):
                    if i:
                        await asyncio.sleep(0.02)
                    writer.write(piece)
                    await writer.drain()
                if then == "close":
                    return
                if then == "hang":  # silent until the client (or the teardown) closes
                    with contextlib.suppress(ConnectionError):
                        while await reader.read(65536):
                            pass
                    return
        finally:
            stats.open -= 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        yield (f"https://localhost:{port}" if tls else f"http://127.0.0.1:{port}"), stats
    finally:
        # Handlers end by themselves (cancelling a stream handler makes asyncio log an error).
        server.close()
        for w in writers:
            w.close()
        if handlers:
            await asyncio.wait(handlers, timeout=5)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


H = {"Host": "127.0.0.1"}


def test_content_length_body_keep_alive_and_case_insensitive_headers() -> None:
    body = os.urandom(300_000)

    async def go() -> None:
        async with serve(lambda c, r: (ok(body), "keep")) as (origin, stats):
            pool = H1Pool(4)
            for _ in range(5):
                resp = await pool.get(origin, "/k?x=1", H, 30)
                assert (resp.status, resp.body, resp.content_length) == (200, body, len(body))
                assert resp.headers.get("x-TEST") == "yes" and resp.headers.get("ETag") is None
            assert (stats.connections, stats.requests) == (1, 5)  # one keep-alive connection, reused
            await pool.aclose()
            assert not pool._conns

    run(go())


def test_a_body_asked_as_its_buffer_is_the_buffer_received_into_an_error_body_stays_bytes() -> None:
    """``as_buffer=True`` (a caller that cuts the body up, the peers' answers): a 2xx body is handed
    over as the buffer it was received into, whole (one copy of the body fewer), framed as any body
    is (Content-Length: a view of the buffer it was received into, never zeroed first and every byte
    of it written; chunked: a bytearray); a non-2xx body stays ``body`` (bytes, cut as ever)."""
    body = os.urandom(300_000)
    chunked = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n", b"0\r\n\r\n"]
    error = [b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy"]
    replies = {0: ok(body), 1: chunked, 2: error, 3: ok(b""), 4: ok(body)}

    async def go() -> None:
        async with serve(lambda c, r: (replies[r], "keep")) as (origin, stats):
            pool = H1Pool(1)
            got = [await pool.get(origin, "/", H, 30, as_buffer=True) for _ in range(4)]
            assert [(r.status, r.body) for r in got] == [(200, b""), (200, b""), (503, b"busy"), (200, b"")]
            assert [None if r.buffer is None else bytes(r.buffer) for r in got] == [body, b"hello", None, b""]
            assert [type(r.buffer) for r in got] == [memoryview, bytearray, type(None), memoryview]
            plain = await pool.get(origin, "/", H, 30)  # the next request on the connection: bytes again
            assert (plain.body, plain.buffer) == (body, None) and type(plain.body) is bytes
            assert stats.connections == 1
            await pool.aclose()

    run(go())


def test_chunked_body_split_across_reads_then_reuse() -> None:
    pieces = [
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n7;ext=1\r\n<Erro",
        b"r>\r\n",
        b"A\r\n</Error>ab\r\n0\r\nX-Trailer: t\r\n\r\n",
    ]

    async def go() -> None:
        async with serve(lambda c, r: (pieces if r == 0 else ok(b"next"), "keep")) as (origin, stats):
            pool = H1Pool(2)
            resp = await pool.get(origin, "/", H, 30)
            assert (resp.status, resp.body, resp.content_length) == (404, b"<Error></Error>ab", None)
            assert (await pool.get(origin, "/", H, 30)).body == b"next"
            assert stats.connections == 1
            await pool.aclose()

    run(go())


def test_large_error_body_is_cut_and_informational_heads_skipped() -> None:
    big = b"e" * 200_000
    error = [b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % len(big) + big]
    then_ok = [b"HTTP/1.1 100 Continue\r\n\r\n", ok(b"fine")[0]]

    async def go() -> None:
        async with serve(lambda c, r: (error if c == 0 else then_ok, "keep")) as (origin, stats):
            pool = H1Pool(1)
            resp = await pool.get(origin, "/", H, 30)
            assert resp.status == 500 and resp.body == big[:ERROR_BODY_CAP]
            resp = await pool.get(origin, "/", H, 30)
            assert (resp.status, resp.body) == (200, b"fine")
            assert stats.connections == 2  # the cut body's connection was not reused
            await pool.aclose()

    run(go())


def test_close_delimited_body() -> None:
    async def go() -> None:
        reply = [b"HTTP/1.1 200 OK\r\n\r\nhello ", b"world"]
        async with serve(lambda c, r: (reply, "close")) as (origin, stats):
            pool = H1Pool(2)
            for _ in range(2):
                assert (await pool.get(origin, "/", H, 30)).body == b"hello world"
            assert stats.connections == 2  # a close-delimited body leaves nothing to reuse
            await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    "pieces",
    [ok(b"x", "Connection: close"), ok(b"x", version="1.0"), ok(b"x", "Connection: Keep-Alive, Close")],
)
def test_connection_close_and_http10_are_honoured(pieces: list[bytes]) -> None:
    async def go() -> None:
        # The server would keep the connection: only the client's reading of the head closes it.
        async with serve(lambda c, r: (pieces, "keep")) as (origin, stats):
            pool = H1Pool(2)
            for _ in range(3):
                assert (await pool.get(origin, "/", H, 30)).body == b"x"
            assert stats.connections == 3
            await pool.aclose()

    run(go())


def test_http10_keep_alive_is_reused() -> None:
    async def go() -> None:
        async with serve(lambda c, r: (ok(b"x", "Connection: keep-alive", version="1.0"), "keep")) as (
            origin,
            stats,
        ):
            pool = H1Pool(2)
            for _ in range(3):
                await pool.get(origin, "/", H, 30)
            assert stats.connections == 1
            await pool.aclose()

    run(go())


def test_reused_connection_closed_at_request_fails_once_without_hidden_retry() -> None:
    def reply(conn: int, req: int) -> Reply:
        return ([], "close") if (conn, req) == (0, 1) else (ok(b"fine"), "keep")

    async def go() -> None:
        async with serve(reply) as (origin, stats):
            pool = H1Pool(2)
            assert (await pool.get(origin, "/", H, 30)).body == b"fine"
            with pytest.raises(ConnectionLost, match="reused"):
                await pool.get(origin, "/", H, 30)
            assert stats.requests == 2  # the failed request was sent once, not resent
            assert (await pool.get(origin, "/", H, 30)).body == b"fine"
            assert (stats.connections, stats.requests) == (2, 3)
            await pool.aclose()

    run(go())


def test_idle_connection_closed_by_server_is_replaced_quietly() -> None:
    async def go() -> None:
        # The server closes after each reply without saying so; the client sees the FIN while idle.
        async with serve(lambda c, r: (ok(b"x"), "close")) as (origin, stats):
            pool = H1Pool(2)
            for _ in range(3):
                assert (await pool.get(origin, "/", H, 30)).body == b"x"
                await asyncio.sleep(0.05)
            assert (stats.connections, stats.requests) == (3, 3)
            await pool.aclose()

    run(go())


def test_idle_timeout_closes_pooled_connections() -> None:
    async def go() -> None:
        async with serve(lambda c, r: (ok(b"x"), "keep")) as (origin, stats):
            pool = H1Pool(2, idle_timeout=0.2)
            await pool.get(origin, "/", H, 30)
            assert stats.open == 1
            await asyncio.sleep(0.6)
            assert stats.open == 0 and not pool._conns
            await pool.get(origin, "/", H, 30)
            assert stats.connections == 2
            await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", b"x" * 500],
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n0123456789"],
    ],
)
def test_truncated_body_is_incomplete(pieces: list[bytes]) -> None:
    async def go() -> None:
        async with serve(lambda c, r: (pieces, "close")) as (origin, _):
            pool = H1Pool(2)
            with pytest.raises(IncompleteBody):
                await pool.get(origin, "/", H, 30)
            await pool.aclose()

    run(go())


@pytest.mark.parametrize(
    "pieces",
    [
        [b"HTXP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"],
        [b"HTTP/1.1 2000 OK\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
        [b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000],
    ],
)
def test_malformed_response_is_bad_and_pool_recovers(pieces: list[bytes]) -> None:
    def reply(conn: int, req: int) -> Reply:
        return (pieces, "keep") if conn == 0 else (ok(b"good"), "keep")

    async def go() -> None:
        async with serve(reply) as (origin, stats):
            pool = H1Pool(1)
            with pytest.raises(BadResponse):
                await pool.get(origin, "/", H, 30)
            assert (await pool.get(origin, "/", H, 30)).body == b"good"
            assert stats.connections == 2
            await pool.aclose()

    run(go())


def test_timeout_fires_within_bound_and_drops_the_connection() -> None:
    async def go() -> None:
        async with serve(lambda c, r: ([b"HTTP/1.1 200 OK\r\nContent-Le"], "hang")) as (origin, stats):
            pool = H1Pool(1)
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await pool.get(origin, "/", H, 0.3)
            assert 0.25 <= time.monotonic() - t0 < 2.0
            await asyncio.sleep(0.05)
            assert stats.open == 0 and not pool._conns
            await pool.aclose()

    run(go())


def test_waiting_for_a_free_connection_counts_against_the_deadline() -> None:
    async def go() -> None:
        async with serve(lambda c, r: ([], "hang")) as (origin, stats):
            pool = H1Pool(1)
            first = asyncio.ensure_future(pool.get(origin, "/", H, 30))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await pool.get(origin, "/", H, 0.2)
            assert time.monotonic() - t0 < 2.0 and stats.connections == 1
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert pool._busy == 0 and not pool._waiters
            await pool.aclose()

    run(go())


def test_cancelled_request_discards_its_connection() -> None:
    def reply(conn: int, req: int) -> Reply:
        if conn == 0:  # the head and part of the body, then silence
            return [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"p" * 10], "hang"
        return ok(b"after"), "keep"

    async def go() -> None:
        async with serve(reply) as (origin, stats):
            pool = H1Pool(1)
            task = asyncio.ensure_future(pool.get(origin, "/", H, 10))
            while stats.requests == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            resp = await pool.get(origin, "/", H, 30)
            assert resp.body == b"after" and stats.connections == 2
            await asyncio.sleep(0.05)
            assert stats.open == 1 and len(pool._conns) == 1  # the half-read one is closed
            await pool.aclose()

    run(go())


def test_pool_limit_is_respected() -> None:
    async def go() -> None:
        async with serve(lambda c, r: (ok(b"%d" % c), "keep"), delay=0.05) as (origin, stats):
            pool = H1Pool(3)
            out = await asyncio.gather(*(pool.get(origin, "/", H, 10) for _ in range(10)))
            assert all(r.status == 200 for r in out)
            assert stats.max_open <= 3 and stats.connections <= 3 and stats.requests == 10
            await pool.aclose()
            await asyncio.sleep(0.05)
            assert stats.open == 0

    run(go())


def test_pool_limit_is_global_across_origins() -> None:
    async def go() -> None:
        async with (
            serve(lambda c, r: (ok(b"a"), "keep")) as (a, sa),
            serve(lambda c, r: (ok(b"b"), "keep")) as (b, sb),
        ):
            pool = H1Pool(1)
            for origin in (a, b, a):
                await pool.get(origin, "/", H, 30)
            await asyncio.sleep(0.05)
            assert sa.open + sb.open == 1 and (sa.connections, sb.connections) == (2, 1)
            await pool.aclose()

    run(go())


def test_tls_verify_modes_and_sni(tmp_path: Any) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=20,
    )  # fmt: skip
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    names: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: names.append(name)  # type: ignore[assignment,func-returns-value]

    async def go() -> None:
        async with serve(lambda c, r: (ok(b"secret"), "keep"), tls=server_ctx) as (origin, stats):
            for verify in (str(cert), False):
                pool = H1Pool(2, verify=verify)
                for _ in range(2):
                    assert (await pool.get(origin, "/", {"Host": "localhost"}, 10)).body == b"secret"
                await pool.aclose()
            assert names == ["localhost", "localhost"] and stats.connections == 2  # SNI, keep-alive
            pool = H1Pool(2)  # the system CAs do not know this certificate
            with pytest.raises(ssl.SSLCertVerificationError):
                await pool.get(origin, "/", {"Host": "localhost"}, 10)
            await pool.aclose()

    run(go())


# -- against the S3 server ---------------------------------------------------------------------
def test_s3_reader_reads_ranges_and_errors_over_one_connection(s3_bucket: Any) -> None:
    data = os.urandom(250_000)
    s3_bucket.put("d/a.bin", data)
    reader = S3Reader(s3_bucket.storage_options, concurrency=4)

    async def go() -> None:
        whole = await reader.read(s3_bucket.name, "d/a.bin")
        assert whole.body == data and whole.total == len(data)
        part = await reader.read(s3_bucket.name, "d/a.bin", start=10, end=20)
        assert part.body == data[10:20] and part.total == len(data)
        with pytest.raises(FileNotFoundError):
            await reader.read(s3_bucket.name, "d/missing.bin")
        pool = reader._pools.get()
        assert len(pool._conns) == 1  # every request, the 404 included, kept the connection
        await reader.close()
        assert not pool._conns

    run(go())


def test_s3_reader_maps_transport_failures(s3_bucket: Any) -> None:
    async def go() -> None:
        def reply(conn: int, req: int) -> Reply:
            return [b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc"], "close"

        async with serve(reply) as (origin, _):
            reader = S3Reader({"endpoint_url": origin, "anon": True}, concurrency=2)
            with pytest.raises(TransientError) as info:
                await reader.read("b", "k")
            assert info.value.kind == "short_read"
            await reader.close()
        async with serve(lambda c, r: ([b"garbage\r\n\r\n"], "keep")) as (origin, _):
            reader = S3Reader({"endpoint_url": origin, "anon": True}, concurrency=2)
            with pytest.raises(TransientError) as info:
                await reader.read("b", "k")
            assert info.value.kind == "server"
            await reader.close()
        async with serve(lambda c, r: ([], "hang")) as (origin, _):
            reader = S3Reader({"endpoint_url": origin, "anon": True}, concurrency=2)
            with pytest.raises(TransientError) as info:
                await reader.read("b", "k", timeout=0.2)
            assert info.value.kind == "timeout"
            await reader.close()

    run(go())


def test_fork_child_gets_its_own_pool(s3_bucket: Any) -> None:
    s3_bucket.put("f.bin", b"forked")
    reader = S3Reader(s3_bucket.storage_options, concurrency=2)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(reader.read(s3_bucket.name, "f.bin")).body == b"forked"

        async def pool() -> H1Pool:
            return reader._pools.get()

        parent = loop.run_until_complete(pool())
        parent_conns = set(parent._conns)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork in a threaded process (3.12+)
            pid = os.fork()
        if pid == 0:  # the child: exit code 0 when it made its own pool and read through it
            code = 1
            try:
                child = loop.run_until_complete(pool())  # same loop object, another process
                code = 2 if child is parent or child._conns else 3
                if code == 3:
                    # I/O on a fresh loop: the inherited one shares its epoll instance with the parent.
                    body = asyncio.run(reader.read(s3_bucket.name, "f.bin")).body
                    code = 0 if body == b"forked" else 4
            finally:
                os._exit(code)
        assert wait_child(pid, 20) == 0
        # The parent's pool and its connection are untouched and still work.
        assert loop.run_until_complete(reader.read(s3_bucket.name, "f.bin")).body == b"forked"
        assert loop.run_until_complete(pool()) is parent and set(parent._conns) == parent_conns
        loop.run_until_complete(reader.close())
    finally:
        loop.close()


def test_process_bound_holds_h1_pools() -> None:
    async def go() -> None:
        bound: ProcessBound[H1Pool] = ProcessBound(lambda: H1Pool(2), H1Pool.aclose)
        assert bound.get() is bound.get()
        await bound.aclose()

    run(go())

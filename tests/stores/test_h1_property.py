"""Property: whatever bytes a server sends after a request, blobdata's HTTP/1.1 client gives either the
right body or an error (``BadResponse``, or a ``ConnectionError`` for a cut stream) before the
deadline: it never hangs, and never allocates beyond the body it asked for.

Each example is served over a real socket on 127.0.0.1, in pieces, and the connection is then closed;
allocation is measured with ``tracemalloc`` around the request.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobdata._stores.h1 import BadResponse, H1Pool

pytestmark = pytest.mark.timeout(240)

MAX_BODY = 20_000  # what each request asks for, in bytes
SLACK = 256 * 1024  # the parser's own buffers (head, a 16 KiB read buffer, asyncio's objects)


@st.composite
def valid_response(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """(the bytes of a well-formed 200/206 response, its body, whether the request was ranged)."""
    body = draw(st.binary(max_size=MAX_BODY))
    ranged = draw(st.booleans())
    status = b"206 Partial Content" if ranged else b"200 OK"
    head = [b"HTTP/1.1 " + status]
    if draw(st.booleans()):
        head.insert(0, b"HTTP/1.1 100 Continue\r\n")  # an informational head first
    name_case = draw(st.sampled_from([str.lower, str.upper, str.title]))
    extra = draw(st.lists(st.sampled_from([b"ETag: \"x\"", b"X-Amz-Id: 1", b"Server:  s3 "]), max_size=3))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if framing == "length":
        head.append(name_case("content-length").encode() + b": %d" % len(body))
        payload = body
    elif framing == "chunked":
        head.append(name_case("transfer-encoding").encode() + b": chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        ext = draw(st.sampled_from([b"", b";name=value"]))
        payload = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in pieces)
        payload += b"0\r\n" + draw(st.sampled_from([b"", b"X-Trailer: t\r\n"])) + b"\r\n"
    else:
        head.append(b"Connection: close")
        payload = body
    data = b"\r\n".join(head + extra) + b"\r\n\r\n" + payload
    return data, body, ranged


def _split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=5)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[list[bytes], bool]:
    """(pieces of a damaged or arbitrary response, whether the request was ranged)."""
    data, _, ranged = draw(valid_response())
    kind = draw(st.sampled_from(["flip", "cut", "insert", "arbitrary", "number"]))
    if kind == "arbitrary":
        data = draw(st.binary(max_size=4000))
    elif kind == "number":  # a length or chunk size that asks for much more than was asked
        big = b"%d" % draw(st.integers(MAX_BODY + 1, 10**30) | st.integers(10**6, 10**8))
        data = data.replace(b"Content-Length: ", b"Content-Length: " + big + b"0", 1).replace(
            b"\r\n\r\n", b"\r\n\r\n" + big[:15] + b"\r\n", 1
        )
    elif data:
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
        elif kind == "cut":
            data = data[:at]
        else:
            data = data[:at] + draw(st.binary(min_size=1, max_size=64)) + data[at:]
    return _split(draw, data), ranged


async def _exchange(pieces: list[bytes], ranged: bool) -> tuple[Any, int]:
    """Serve ``pieces`` (then close) to one GET; (the Response or the exception, peak bytes)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = H1Pool(1)
    headers = {"Host": "127.0.0.1", **({"Range": "bytes=0-"} if ranged else {})}
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    try:
        origin = f"http://127.0.0.1:{port}"
        out: Any = await pool.get(origin, "/k", headers, 5.0, max_body=MAX_BODY, ranged=ranged)
    except Exception as exc:
        out = exc
    peak = tracemalloc.get_traced_memory()[1] - base
    await pool.aclose()
    server.close()
    await server.wait_closed()
    return out, peak


@pytest.fixture(scope="module", autouse=True)
def traced() -> Any:
    tracemalloc.start()
    yield
    tracemalloc.stop()


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(valid_response(), st.data())
def test_a_well_formed_response_gives_its_body(case: tuple[bytes, bytes, bool], data: st.DataObject) -> None:
    raw, body, ranged = case
    out, peak = asyncio.run(_exchange(_split(data.draw, raw), ranged))
    assert not isinstance(out, BaseException), out
    assert out.body == body and out.status == (206 if ranged else 200)
    assert peak < 3 * MAX_BODY + SLACK


@_SETTINGS
@given(mutated())
def test_any_bytes_give_a_bounded_body_or_an_error_in_time(case: tuple[list[bytes], bool]) -> None:
    pieces, ranged = case
    out, peak = asyncio.run(_exchange(pieces, ranged))
    if isinstance(out, BaseException):
        # Never the deadline: every stream here ends (the server closes), so the client must decide.
        assert isinstance(out, (BadResponse, ConnectionError)), repr(out)
    elif 200 <= out.status < 300:
        assert len(out.body) <= MAX_BODY
    assert peak < 3 * MAX_BODY + SLACK, f"{peak} bytes for a body of at most {MAX_BODY}"

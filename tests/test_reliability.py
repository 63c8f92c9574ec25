"""Bad input that once misbehaved: a listing endpoint that never answers, a worker's error losing its
URL on the way to the main process, a truncated body reported as a changed object."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from blobdata import FetchOptions, FetchTimeout, FolderDataset, NotFound
from blobdata._errors import FetchError, ObjectChanged
from blobdata._fetch import FetchEngine
from blobdata._loop import run


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextlib.contextmanager
def _serve(handle: Any) -> Iterator[tuple[str, list[int]]]:
    """A raw TCP server on 127.0.0.1 calling ``handle(sock, n)`` for connection n; (endpoint, counter)."""
    count = [0]
    lock = threading.Lock()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            with lock:
                count[0] += 1
                n = count[0]
            handle(self.request, n)

    server = _Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", count
    finally:
        server.shutdown()
        server.server_close()


def _silent(sock: socket.socket, n: int) -> None:
    sock.settimeout(30)
    with contextlib.suppress(OSError):
        while sock.recv(65536):
            pass  # reads the request, never answers


@pytest.mark.timeout(60)
def test_listing_obeys_timeout_and_attempts() -> None:
    """Before: 30 s per try whatever FetchOptions said (~3 min); now 2 attempts of 1 s."""
    with _serve(_silent) as (endpoint, count):
        opts = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        with pytest.raises(FetchTimeout) as info:
            FolderDataset(
                "s3://bucket/train", storage_options=opts, fetch_options=FetchOptions(timeout=1, retries=2)
            )
        assert "s3://bucket/train" in str(info.value) and "1s" in str(info.value)
        assert info.value.url == "s3://bucket/train"
        assert count[0] == 2  # one connection per attempt, no more


@pytest.mark.timeout(60)
def test_listing_through_s3fs_obeys_timeout() -> None:
    """Options only s3fs understands (version_aware) list through s3fs: bounded all the same."""
    with _serve(_silent) as (endpoint, _count):
        opts = {"endpoint_url": endpoint, "key": "k", "secret": "s", "version_aware": True}
        with pytest.raises(FetchTimeout):
            FolderDataset(
                "s3://bucket/train", storage_options=opts, fetch_options=FetchOptions(timeout=1, retries=2)
            )


def _truncating(full: bytes, truncated_connections: int) -> Any:
    def handle(sock: socket.socket, n: int) -> None:
        sock.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        body = full[: len(full) // 2] if n <= truncated_connections else full
        # No Content-Length: the body ends when the server closes, so a cut looks complete to HTTP.
        sock.sendall(b'HTTP/1.1 200 OK\r\nETag: "abc"\r\nConnection: close\r\n\r\n' + body)
        sock.shutdown(socket.SHUT_WR)

    return handle


def _engine_fetch(endpoint: str, size: int, identity: str | None) -> tuple[FetchEngine, Any]:
    engine = FetchEngine(
        FetchOptions(retries=3, backoff=0.01), "s3", {"endpoint_url": endpoint, "anon": True}
    )
    try:
        return engine, run(engine.fetch("s3://bucket/obj", size=size, identity=identity), 30)
    except BaseException as exc:
        return engine, exc
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_truncated_body_is_retried_not_object_changed() -> None:
    full = bytes(range(256)) * 40
    with _serve(_truncating(full, truncated_connections=1)) as (endpoint, count):
        engine, got = _engine_fetch(endpoint, len(full), "abc")
    assert got == (full, "abc"), got
    assert count[0] == 2 and engine.stats()["errors"] == {"short_read": 1}


@pytest.mark.timeout(60)
def test_always_truncated_body_is_a_fetch_error() -> None:
    full = bytes(range(256)) * 40
    with _serve(_truncating(full, truncated_connections=99)) as (endpoint, count):
        _engine, got = _engine_fetch(endpoint, len(full), "abc")
    assert isinstance(got, FetchError) and not isinstance(got, ObjectChanged), repr(got)
    assert "s3://bucket/obj" in str(got) and "3 attempts" in str(got) and count[0] == 3


@pytest.mark.timeout(60)
def test_different_size_with_unknown_identity_is_still_object_changed() -> None:
    full = bytes(range(256)) * 40
    with _serve(_truncating(full, truncated_connections=0)) as (endpoint, _count):
        _engine, got = _engine_fetch(endpoint, len(full) + 7, None)
    assert isinstance(got, ObjectChanged), repr(got)


@pytest.mark.network
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_error_keeps_its_url(s3_bucket: Any, method: str) -> None:
    s3_bucket.put_many({f"w/c{i % 2}/{i}.png": b"x" for i in range(4)})
    ds = FolderDataset(s3_bucket.url("w"), storage_options=s3_bucket.storage_options, lookahead=0)
    gone = s3_bucket.url("w/c0/0.png")
    s3_bucket.delete("w/c0/0.png")
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=1, multiprocessing_context=method, timeout=60
    )
    with pytest.raises(NotFound) as info:
        list(loader)
    assert info.value.url == gone
    assert "DataLoader worker" in str(info.value) and gone in str(info.value)

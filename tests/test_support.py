"""The test infrastructure itself: real servers, fresh buckets, the latency/fault proxy."""

from __future__ import annotations

import http.client
import http.server
import os
import select
import socket
import threading
import time
from typing import Any

import pytest

from blobdata.testing import LatencyProxy, LocalS3Server, S3Endpoint, _wire, find_free_port, s3_client

pytestmark = pytest.mark.network

TRICKY_KEY = "dir with space/ünïcödé+plus sign/file €+1.bin"


def _client(endpoint: S3Endpoint, endpoint_url: str | None = None, timeout_s: float = 5.0) -> Any:
    target = S3Endpoint(endpoint_url or endpoint.endpoint_url, endpoint.access_key, endpoint.secret_key)
    return s3_client(target, timeout_s=timeout_s)


# -------------------------------------------------------------------------------------- servers


def test_s3_round_trips_unicode_space_and_plus_keys(s3_bucket: Any, s3_server: S3Endpoint) -> None:
    payload = os.urandom(10_000)
    s3_bucket.put(TRICKY_KEY, payload)
    client = s3_client(s3_server)
    assert client.get_object(Bucket=s3_bucket.name, Key=TRICKY_KEY)["Body"].read() == payload
    listed = client.list_objects_v2(Bucket=s3_bucket.name)["Contents"]
    assert [o["Key"] for o in listed] == [TRICKY_KEY]
    assert s3_bucket.url("a/b") == f"s3://{s3_bucket.name}/a/b"


def test_s3_round_trip_through_s3fs(s3_bucket: Any) -> None:
    import s3fs

    s3_bucket.put_many({f"many/{i:04d}.bin": bytes([i % 256]) * 10 for i in range(200)})
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_bucket.storage_options)
    names = fs.ls(f"{s3_bucket.name}/many", detail=False)
    assert len(names) == 200
    assert fs.cat_file(f"{s3_bucket.name}/many/0007.bin", start=2, end=5) == b"\x07" * 3
    s3_bucket.delete("many/0007.bin")
    fs.invalidate_cache()
    assert len(fs.ls(f"{s3_bucket.name}/many", detail=False)) == 199


def test_buckets_are_fresh_per_test(s3_bucket: Any, s3_server: S3Endpoint) -> None:
    assert s3_client(s3_server).list_objects_v2(Bucket=s3_bucket.name).get("KeyCount", 0) == 0


@pytest.mark.slow
def test_moto_backend_starts_and_stops() -> None:
    with LocalS3Server(backend="moto") as server:
        pid, tmpdir = server.pid, server.tmpdir
        assert pid is not None and tmpdir is not None and tmpdir.exists()
        server.create_bucket("moto-bucket")
        client = s3_client(server)
        client.put_object(Bucket="moto-bucket", Key=TRICKY_KEY, Body=b"x")
        assert client.get_object(Bucket="moto-bucket", Key=TRICKY_KEY)["Body"].read() == b"x"
    assert server.pid is None and not tmpdir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_server_that_cannot_start_raises_with_log_tail() -> None:
    server = LocalS3Server()
    server._command = lambda tmpdir: ["sh", "-c", "echo boom-from-server; exit 3"]  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom-from-server"):
        server.start(attempts=1)
    assert server.pid is None


# ---------------------------------------------------------------------------------------- proxy


def test_proxy_adds_the_round_trip_time(s3_bucket: Any, s3_server: S3Endpoint) -> None:
    s3_bucket.put("rtt.bin", b"r")
    with LatencyProxy(*_host_port(s3_server), delay_s=0.05) as proxy:
        client = _client(s3_server, proxy.endpoint_url)
        client.get_object(Bucket=s3_bucket.name, Key="rtt.bin")["Body"].read()  # warm the connection
        t0 = time.monotonic()
        client.get_object(Bucket=s3_bucket.name, Key="rtt.bin")["Body"].read()
        assert time.monotonic() - t0 >= 0.09  # RTT = 2 x 50 ms


def test_proxy_takes_a_burst_of_connections_while_busy(s3_server: S3Endpoint) -> None:
    # 8 DataLoader workers open 64 connections each at once. With asyncio's default listen backlog
    # (100) the kernel dropped the SYNs beyond it while the proxy's loop was busy, and each dropped
    # SYN cost its client a 1 s retransmit: +1 s on the first batch and 30% of a short epoch.
    with LatencyProxy(*_host_port(s3_server), delay_s=0.0) as proxy:
        assert proxy._loop is not None
        proxy._loop.call_soon_threadsafe(time.sleep, 1.5)  # the loop accepts nothing for 1.5 s
        time.sleep(0.1)
        socks = []
        try:
            for _ in range(400):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", proxy.port))
                socks.append(s)
            deadline = time.monotonic() + 0.8  # the kernel completes each handshake: well inside 1 s
            pending = set(socks)
            while pending and time.monotonic() < deadline:
                _, writable, _ = select.select([], list(pending), [], 0.05)
                pending -= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
            assert not pending, f"{len(pending)} of 400 connections were not accepted within 0.8 s"
        finally:
            for s in socks:
                s.close()


def test_proxy_delay_does_not_cap_throughput(s3_bucket: Any, s3_server: S3Endpoint) -> None:
    # 8 MiB through a 100 ms RTT: a proxy that slept per 64 KiB chunk would take 128 x 50 ms = 6.4 s.
    payload = os.urandom(8 * 1024 * 1024)
    s3_bucket.put("big.bin", payload)
    with LatencyProxy(*_host_port(s3_server), delay_s=0.05) as proxy:
        client = _client(s3_server, proxy.endpoint_url, timeout_s=30)
        t0 = time.monotonic()
        assert client.get_object(Bucket=s3_bucket.name, Key="big.bin")["Body"].read() == payload
        assert time.monotonic() - t0 < 3.0


def test_proxy_bandwidth_cap(s3_bucket: Any, s3_server: S3Endpoint) -> None:
    s3_bucket.put("bw.bin", b"b" * 2_000_000)
    with LatencyProxy(*_host_port(s3_server), bandwidth_bytes_per_s=4_000_000) as proxy:
        client = _client(s3_server, proxy.endpoint_url, timeout_s=30)
        t0 = time.monotonic()
        client.get_object(Bucket=s3_bucket.name, Key="bw.bin")["Body"].read()
        # 2 MB at 4 MB/s is 0.5 s; the last chunk read from the server (<= 256 KiB) leaves at the
        # start of its slot, so at least 0.43 s: 0.3 s leaves room and a slow machine only adds time.
        assert time.monotonic() - t0 >= 0.3


def test_proxy_back_pressure_keeps_every_byte_in_order(
    s3_bucket: Any, s3_server: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow reader behind a small delay buffer: the proxy must stop reading from the server (not
    # buffer without bound) and resume, and the body must still arrive whole and in order.
    payload = os.urandom(6 * 1024 * 1024)
    s3_bucket.put("slow.bin", payload)
    monkeypatch.setattr(_wire, "PENDING_BYTES", 256 * 1024)
    with LatencyProxy(*_host_port(s3_server), delay_s=0.005) as proxy:
        client = _client(s3_server, proxy.endpoint_url, timeout_s=30)
        body = client.get_object(Bucket=s3_bucket.name, Key="slow.bin")["Body"]
        chunks = []
        while chunk := body.read(256 * 1024):
            chunks.append(chunk)
            time.sleep(0.01)
        assert b"".join(chunks) == payload
        assert proxy.read_pauses > 0


def test_proxy_counts_requests_on_keep_alive_connections(s3_bucket: Any, s3_proxy: Any) -> None:
    s3_bucket.put("c.bin", b"c" * 1000)
    client = _client(s3_proxy.server, s3_proxy.endpoint_url)
    client.put_object(Bucket=s3_bucket.name, Key="up.bin", Body=b"u" * 70_000)  # a body to skip
    s3_proxy.reset_counts()
    for _ in range(3):
        client.get_object(Bucket=s3_bucket.name, Key="c.bin")["Body"].read()
    assert s3_proxy.requests == [("GET", f"/{s3_bucket.name}/c.bin")] * 3
    client.head_object(Bucket=s3_bucket.name, Key="c.bin")
    client.list_objects_v2(Bucket=s3_bucket.name, Prefix="c")
    methods = [m for m, _ in s3_proxy.requests]
    assert methods == ["GET", "GET", "GET", "HEAD", "GET"]
    assert "list-type=2" in s3_proxy.requests[-1][1]


class _KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep connections open between requests

    def _answer(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                self.rfile.read(size + 2)
                if size == 0:
                    break
        else:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b"ok " + self.path.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def keep_alive_target() -> Any:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_proxy_counts_each_request_of_a_keep_alive_connection(keep_alive_target: int) -> None:
    with LatencyProxy("127.0.0.1", keep_alive_target) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        conn.request("PUT", "/a", body=b"x" * 200_000)  # a body longer than one read
        assert conn.getresponse().read() == b"ok /a"
        conn.request("POST", "/b?q=1", body=iter([b"abc", b"defgh"]), encode_chunked=True)
        assert conn.getresponse().read() == b"ok /b?q=1"
        for _ in range(3):
            conn.request("GET", "/c")
            assert conn.getresponse().read() == b"ok /c"
        conn.close()
        assert proxy.requests == [("PUT", "/a"), ("POST", "/b?q=1")] + [("GET", "/c")] * 3
        assert proxy.connections_opened == 1


def _error_code(exc: BaseException) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("status503", "SlowDown"), ("status500", "InternalError")],
)
def test_proxy_status_faults(s3_bucket: Any, s3_proxy: Any, mode: str, expected: str) -> None:
    from botocore.exceptions import ClientError

    s3_bucket.put("f.bin", b"f")
    client = _client(s3_proxy.server, s3_proxy.endpoint_url)
    s3_proxy.fail_next(2, mode)
    for _ in range(2):
        with pytest.raises(ClientError) as info:
            client.get_object(Bucket=s3_bucket.name, Key="f.bin")
        assert _error_code(info.value) == expected
        status = info.value.response["ResponseMetadata"]["HTTPStatusCode"]
        assert status == (503 if mode == "status503" else 500)
    # The connection stays usable and the third request goes through.
    assert client.get_object(Bucket=s3_bucket.name, Key="f.bin")["Body"].read() == b"f"
    assert len(s3_proxy.requests) == 3 and s3_proxy.faults_triggered == 2


def test_proxy_fault_filtered_by_method(s3_bucket: Any, s3_proxy: Any) -> None:
    from botocore.exceptions import ClientError

    s3_bucket.put("m.bin", b"m")
    client = _client(s3_proxy.server, s3_proxy.endpoint_url)
    s3_proxy.fail_next(1, "status503", method="GET")
    client.head_object(Bucket=s3_bucket.name, Key="m.bin")  # HEAD passes
    with pytest.raises(ClientError):
        client.get_object(Bucket=s3_bucket.name, Key="m.bin")


@pytest.mark.parametrize("mode", ["reset", "close"])
def test_proxy_connection_faults(s3_bucket: Any, s3_proxy: Any, mode: str) -> None:
    s3_bucket.put("k.bin", b"k")
    s3_proxy.fail_next(1, mode)
    conn = http.client.HTTPConnection("127.0.0.1", s3_proxy.port, timeout=5)
    conn.request("GET", f"/{s3_bucket.name}/k.bin")
    if mode == "reset":
        with pytest.raises(ConnectionResetError):
            conn.getresponse()
    else:
        with pytest.raises(http.client.RemoteDisconnected):
            conn.getresponse()
    conn.close()
    assert s3_proxy.requests == [("GET", f"/{s3_bucket.name}/k.bin")]


@pytest.mark.parametrize("mode", ["reset", "close"])
def test_proxy_connection_faults_seen_by_botocore(s3_bucket: Any, s3_proxy: Any, mode: str) -> None:
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    s3_bucket.put("k.bin", b"k")
    client = _client(s3_proxy.server, s3_proxy.endpoint_url)
    s3_proxy.fail_next(1, mode)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        client.get_object(Bucket=s3_bucket.name, Key="k.bin")
    assert client.get_object(Bucket=s3_bucket.name, Key="k.bin")["Body"].read() == b"k"


def test_proxy_stall_never_answers(s3_bucket: Any, s3_proxy: Any) -> None:
    from botocore.exceptions import ReadTimeoutError

    s3_bucket.put("s.bin", b"s")
    client = _client(s3_proxy.server, s3_proxy.endpoint_url, timeout_s=0.5)
    s3_proxy.fail_next(1, "stall")
    t0 = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=s3_bucket.name, Key="s.bin")
    assert 0.4 < time.monotonic() - t0 < 3.0
    assert client.get_object(Bucket=s3_bucket.name, Key="s.bin")["Body"].read() == b"s"


def test_proxy_stop_is_bounded_with_open_connections(s3_server: S3Endpoint) -> None:
    proxy = LatencyProxy(*_host_port(s3_server), delay_s=0.2).start()
    socks = [socket.create_connection(("127.0.0.1", proxy.port), timeout=2) for _ in range(5)]
    proxy.fail_next(1, "stall")
    socks[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.1)
    t0 = time.monotonic()
    proxy.stop()
    assert time.monotonic() - t0 < 1.5
    for s in socks:
        s.settimeout(2)
        assert s.recv(10) == b""  # closed by the proxy
        s.close()
    assert not any(t.name.startswith("latency-proxy") and t.is_alive() for t in threading.enumerate())


def _host_port(server: S3Endpoint) -> tuple[str, int]:
    host, _, port = server.endpoint_url.split("://", 1)[1].rstrip("/").rpartition(":")
    return host, int(port)


# ------------------------------------------------------------------------------------ emulators


def test_azurite_round_trip_through_adlfs(az_bucket: Any) -> None:
    import adlfs

    az_bucket.put_many({"d/a b+ü.bin": b"hello azure", "d/two.bin": b"2"})
    assert az_bucket.url("d") == f"az://{az_bucket.name}/d"
    fs = adlfs.AzureBlobFileSystem(skip_instance_cache=True, **az_bucket.storage_options)
    assert sorted(fs.ls(f"{az_bucket.name}/d", detail=False)) == [
        f"{az_bucket.name}/d/a b+ü.bin",
        f"{az_bucket.name}/d/two.bin",
    ]
    assert fs.cat_file(f"{az_bucket.name}/d/a b+ü.bin", start=6, end=11) == b"azure"


def test_gcs_emulator_round_trip_through_gcsfs(gcs_bucket: Any) -> None:
    import gcsfs

    gcs_bucket.put_many({"d/a b+ü.bin": b"hello gcs", "d/two.bin": b"2"})
    assert gcs_bucket.url("d") == f"gs://{gcs_bucket.name}/d"
    fs = gcsfs.GCSFileSystem(skip_instance_cache=True, timeout=10, **gcs_bucket.storage_options)
    t0 = time.monotonic()
    assert sorted(fs.ls(f"{gcs_bucket.name}/d", detail=False)) == [
        f"{gcs_bucket.name}/d/a b+ü.bin",
        f"{gcs_bucket.name}/d/two.bin",
    ]
    assert fs.cat_file(f"{gcs_bucket.name}/d/a b+ü.bin", start=6, end=9) == b"gcs"
    fs.pipe_file(f"{gcs_bucket.name}/d/put.bin", b"written by gcsfs")
    assert fs.cat_file(f"{gcs_bucket.name}/d/put.bin") == b"written by gcsfs"
    assert time.monotonic() - t0 < 10  # no 60 s stall on the HNS probe


def test_a_port_for_a_later_server_is_below_the_ephemeral_range_free_and_never_given_twice() -> None:
    """find_free_port: outgoing connections never take it between the choice and the listen (the
    kernel assigns them ports from the ephemeral range only); each xdist worker draws in a slice of its
    own; one process is never given the same port twice; and it is free to listen on."""
    from blobdata.testing.ports import _ephemeral_low, _slice, free_ports

    got = [find_free_port() for _ in range(50)] + free_ports(8)
    assert len(set(got)) == 58
    assert all(p in _slice() and p < _ephemeral_low() for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))
        s.listen()


def test_each_xdist_worker_draws_its_ports_in_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from blobdata.testing.ports import _ephemeral_low, _slice

    slices = []
    for k in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{k}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        slices.append(set(_slice()))
    assert all(len(s) > 1000 for s in slices)
    assert not (slices[0] & slices[1] or slices[1] & slices[2] or slices[0] & slices[2])
    assert max(max(s) for s in slices) < _ephemeral_low()

"""The hostile cases of ``tests/test_hostile.py`` against the GCS and Azure read paths (aiohttp).

GCS: ``HostileServer`` serves the GCS JSON API from memory. Azure: ``HostileServer`` sits in front of
Azurite and rewrites its answers (requests are signed, so only the answers can be changed).
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Iterator
from typing import Any

import pytest

from blobdata._config import FetchOptions
from blobdata._errors import FetchError, FetchTimeout, ObjectChanged
from blobdata._fetch import FetchEngine
from blobdata._loop import run
from blobdata._stores.azure import AzureReader
from blobdata.testing import HostileServer, HttpProxy
from tests.support.tls import self_signed

pytestmark = pytest.mark.timeout(60)

SIZE = 200_000
REFUSED = ["wrong_range", "huge_length", "endless_chunked", "endless_body", "gzip_chunked"]


def _fetch(protocol: str, opts: dict[str, Any], url: str, size: int | None, identity: str | None) -> Any:
    engine = FetchEngine(FetchOptions(attempts=1, timeout=4, part_size=64 * 1024), protocol, opts)
    try:
        return engine.fetch_many_sync([(url, size, identity)])[0]
    finally:
        engine.close()


@pytest.fixture
def gcs_store() -> Iterator[tuple[HostileServer, dict[str, Any]]]:
    with HostileServer() as server:
        yield server, {"endpoint_url": server.endpoint_url, "token": "anon"}


@pytest.mark.parametrize("mode", REFUSED)
def test_gcs_refuses_what_was_not_asked(gcs_store: tuple[HostileServer, dict[str, Any]], mode: Any) -> None:
    store, opts = gcs_store
    data = os.urandom(SIZE)
    store.put("data", "a.bin", data)
    generation = str(store.generation("data", "a.bin"))
    assert _fetch("gs", opts, "gs://data/a.bin", SIZE, generation) == data
    store.mode = mode
    size = None if mode == "gzip_chunked" else SIZE  # unknown size: nothing else would catch it
    got = _fetch("gs", opts, "gs://data/a.bin", size, generation)
    assert isinstance(got, FetchError) and not isinstance(got, FetchTimeout), got
    assert "bad HTTP response" in str(got)


def test_gcs_a_range_answered_whole_is_read_once(gcs_store: tuple[HostileServer, dict[str, Any]]) -> None:
    store, opts = gcs_store
    size = 2 * 1024 * 1024
    data = os.urandom(size)
    store.put("data", "big.bin", data)
    store.mode, store.body_delay_s = "range_ignored", 0.003
    assert _fetch("gs", opts, "gs://data/big.bin", size, str(store.generation("data", "big.bin"))) == data
    assert store.bytes_sent < 4 * size, f"{store.bytes_sent / size:.1f}x the object was sent"


def test_gcs_another_generation_without_its_header_is_caught(
    gcs_store: tuple[HostileServer, dict[str, Any]],
) -> None:
    store, opts = gcs_store
    store.put("data", "a.bin", b"v1" * 50_000)
    listed = str(store.generation("data", "a.bin"))
    store.put("data", "a.bin", b"v2" * 50_000)
    store.mode = "no_etag"  # generation= ignored, no x-goog-generation: the metadata check decides
    got = _fetch("gs", opts, "gs://data/a.bin", 100_000, listed)
    assert isinstance(got, ObjectChanged), got


@pytest.fixture
def az_proxy(az_bucket: Any) -> Iterator[tuple[HostileServer, dict[str, Any], str]]:
    conn = az_bucket.storage_options["connection_string"]
    found = re.search(r"BlobEndpoint=(http://[^/;]+)", conn)
    assert found is not None
    with HostileServer(upstream=found.group(1)) as proxy:
        opts = {"connection_string": conn.replace(found.group(1), proxy.endpoint_url)}
        yield proxy, opts, az_bucket.url("a.bin")


def _az_identity(url: str, opts: dict[str, Any]) -> str:
    async def go() -> str:
        reader = AzureReader(opts)
        try:
            bucket, _, key = url.removeprefix("az://").partition("/")
            return (await reader.read(bucket, key)).identity
        finally:
            await reader.close()

    return run(go(), 30)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", REFUSED)
def test_azure_refuses_what_was_not_asked(
    az_bucket: Any, az_proxy: tuple[HostileServer, dict[str, Any], str], mode: Any
) -> None:
    proxy, opts, url = az_proxy
    data = os.urandom(SIZE)
    az_bucket.put("a.bin", data)
    etag = _az_identity(url, opts)
    assert _fetch("az", opts, url, SIZE, etag) == data
    proxy.mode = mode
    got = _fetch("az", opts, url, None if mode == "gzip_chunked" else SIZE, etag)
    assert isinstance(got, FetchError) and not isinstance(got, FetchTimeout), got
    assert "bad HTTP response" in str(got)


def test_azure_a_pinned_read_without_etag_is_not_a_match(
    az_bucket: Any, az_proxy: tuple[HostileServer, dict[str, Any], str]
) -> None:
    proxy, opts, url = az_proxy
    az_bucket.put("a.bin", b"v1" * 1000)
    etag = _az_identity(url, opts)
    proxy.mode = "no_etag"
    got = _fetch("az", opts, url, 2000, etag)
    assert isinstance(got, ObjectChanged) and "no ETag" in str(got), got


# -- proxies and certificates, as for S3 ---------------------------------------------------------
@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
                 "no_proxy", "NO_PROXY", "REQUEST_METHOD"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_gcs_and_azure_reads_go_through_the_proxy(
    gcs_store: tuple[HostileServer, dict[str, Any]], az_bucket: Any, no_proxy_env: pytest.MonkeyPatch
) -> None:
    store, opts = gcs_store
    store.put("data", "a.bin", b"gcs bytes")
    az_bucket.put("a.bin", b"azure bytes")
    with HttpProxy() as proxy:
        no_proxy_env.setenv("HTTP_PROXY", proxy.url)
        assert _fetch("gs", opts, "gs://data/a.bin", 9, None) == b"gcs bytes"
        assert any(t.startswith(f"{store.endpoint_url}/download/") for _, t in proxy.requests), proxy.requests
        before = len(proxy.requests)
        assert _fetch("az", az_bucket.storage_options, az_bucket.url("a.bin"), 11, None) == b"azure bytes"
        assert len(proxy.requests) > before


def test_gcs_a_refused_certificate_is_final_with_its_reason(
    tmp_path: Any, no_proxy_env: pytest.MonkeyPatch
) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*self_signed(tmp_path))
    with HostileServer(tls=ctx) as store:
        store.put("data", "a.bin", b"x")
        opts = {"endpoint_url": store.endpoint_url, "token": "anon"}
        engine = FetchEngine(FetchOptions(attempts=3, timeout=5), "gs", opts)
        try:
            got = engine.fetch_many_sync([("gs://data/a.bin", 1, None)])[0]
            assert engine.stats()["requests"] == 1  # not retried
        finally:
            engine.close()
    assert isinstance(got, FetchError) and "self-signed certificate" in str(got), got

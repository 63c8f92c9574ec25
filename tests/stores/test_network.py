"""The S3 client on the network users have: HTTP(S)_PROXY / ALL_PROXY / NO_PROXY and
``config_kwargs['proxies']`` as botocore reads them (findings 9), ``AWS_CA_BUNDLE`` and the AWS
config's ``ca_bundle`` (10), final TLS failures with their reason (11).

A real CONNECT and forward proxy (``blobdata.testing.HttpProxy``) and an HTTPS store with a
certificate made here (``blobdata.testing.HostileServer(tls=...)``), all in-process on 127.0.0.1.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blobdata._config import FetchOptions
from blobdata._errors import ConfigError, FetchError
from blobdata._fetch import FetchEngine
from blobdata._stores.s3 import S3Reader
from blobdata.testing import HostileServer, HttpProxy
from tests.support.tls import self_signed

pytestmark = pytest.mark.timeout(60)

_PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
               "no_proxy", "NO_PROXY", "AWS_CA_BUNDLE", "AWS_CONFIG_FILE", "REQUEST_METHOD")  # fmt: skip


@pytest.fixture(autouse=True)
def clean_network_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def https_store(cert: tuple[Path, Path]) -> Iterator[HostileServer]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*cert)
    with HostileServer(tls=ctx) as server:
        server.put("data", "a.bin", b"secret bytes")
        yield server


@pytest.fixture
def http_store() -> Iterator[HostileServer]:
    with HostileServer() as server:
        server.put("data", "a.bin", b"secret bytes")
        yield server


def _read(opts: dict[str, Any], **fetch: Any) -> Any:
    """One fetch of s3://data/a.bin: the bytes, or the error; and the engine's request count."""
    engine = FetchEngine(FetchOptions(**{"attempts": 1, "timeout": 10, **fetch}), "s3", opts)
    try:
        return engine.fetch_many_sync([("s3://data/a.bin", 12, None)])[0], engine.stats()["requests"]
    finally:
        engine.close()


# -- 9: proxies ----------------------------------------------------------------------------------
def test_9_http_proxy_forwards_http_endpoints(
    http_store: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HttpProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        assert _read(http_store.storage_options)[0] == b"secret bytes"
        assert proxy.requests == [("GET", f"{http_store.endpoint_url}/data/a.bin")]


def test_9_https_endpoint_through_an_http_proxy_with_connect(
    https_store: HostileServer, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = {**https_store.storage_options, "client_kwargs": {"verify": str(cert[0])}}
    with HttpProxy(auth=("alice", "p@ss:word")) as proxy:
        monkeypatch.setenv("https_proxy", proxy.url_with("alice", "p%40ss%3Aword"))
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # the other scheme's: not used
        assert _read(opts)[0] == b"secret bytes"
        assert proxy.tunnels == [f"localhost:{https_store.port}"] and proxy.refused == 0
        # NO_PROXY: this host is reached directly (a suffix match, as urllib and botocore match).
        monkeypatch.setenv("NO_PROXY", "example.com, .localhost")
        assert _read(opts)[0] == b"secret bytes"
        assert len(proxy.tunnels) == 1


def test_9_all_proxy_and_config_proxies(http_store: HostileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with HttpProxy() as proxy, HttpProxy() as other:
        monkeypatch.setenv("ALL_PROXY", proxy.url)  # curl's and requests' fallback for every scheme
        assert _read(http_store.storage_options)[0] == b"secret bytes"
        assert len(proxy.requests) == 1
        # botocore's Config(proxies=...), as s3fs users pass it: wins, and the environment is not read.
        opts = {**http_store.storage_options, "config_kwargs": {"proxies": {"http": other.url}}}
        assert _read(opts)[0] == b"secret bytes"
        assert len(proxy.requests) == 1 and len(other.requests) == 1


def test_9_an_unreachable_or_refusing_proxy_is_named(
    http_store: HostileServer, https_store: HostileServer, cert: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("HTTP_PROXY", "http://u:topsecret@127.0.0.1:9")  # nothing listens there
    got, _ = _read(http_store.storage_options)
    assert isinstance(got, FetchError) and "proxy http://***@127.0.0.1:9 (from HTTP_PROXY)" in str(got), got
    assert "topsecret" not in str(got) and http_store.requests == []  # never connected directly
    opts = {**https_store.storage_options, "client_kwargs": {"verify": str(cert[0])}}
    with HttpProxy(auth=("alice", "right")) as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url_with("alice", "wrong"))
        got, requests = _read(opts, attempts=3)
        assert isinstance(got, FetchError) and "407" in str(got) and "HTTPS_PROXY" in str(got), got
        assert proxy.refused == 1 and requests == 1  # final: not retried


@pytest.mark.parametrize(
    ("env", "opts", "named"),
    [
        ({"HTTPS_PROXY": "https://proxy:3128"}, {}, "HTTPS_PROXY"),
        ({"ALL_PROXY": "socks5://proxy:1080"}, {}, "ALL_PROXY"),
        ({}, {"client_kwargs": {"proxies": {"https": "http://p:1"}}}, "client_kwargs['proxies']"),
        ({}, {"config_kwargs": {"proxies_config": {"proxy_ca_bundle": "/x"}}}, "proxies_config"),
        ({}, {"config_kwargs": {"proxies": {"ftp": "http://p:1"}}}, "config_kwargs['proxies']"),
    ],
)
def test_9_unsupported_proxy_forms_are_refused_at_construction(
    env: dict[str, str], opts: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        S3Reader({"endpoint_url": "https://s3.example.com", "anon": True, **opts})
    assert named in str(info.value)


# -- 10, 11: CA bundles, TLS failures ------------------------------------------------------------
def test_10_aws_ca_bundle_and_the_config_files_ca_bundle(
    https_store: HostileServer, cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_CA_BUNDLE", str(cert[0]))
    assert _read(https_store.storage_options)[0] == b"secret bytes"
    monkeypatch.delenv("AWS_CA_BUNDLE")
    config = tmp_path / "config"
    config.write_text(f"[default]\nca_bundle = {cert[0]}\n[profile other]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    assert _read(https_store.storage_options)[0] == b"secret bytes"
    got, _ = _read({**https_store.storage_options, "profile": "other"})  # its profile has none
    assert isinstance(got, FetchError)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError) as info:
        S3Reader(https_store.storage_options)
    assert "AWS_CA_BUNDLE" in str(info.value) and "missing.pem" in str(info.value)


def test_11_a_tls_failure_is_final_with_its_reason(https_store: HostileServer) -> None:
    got, requests = _read(https_store.storage_options, attempts=4)  # the system CAs: unknown issuer
    assert isinstance(got, FetchError), got
    text = str(got)
    assert "self-signed certificate" in text and "AWS_CA_BUNDLE" in text, text
    assert requests == 1 and "failed after" not in text  # not retried: no attempt can succeed
    assert os.environ.get("AWS_CA_BUNDLE") is None

"""A request refused as signed with expired credentials (HTTP 400 ``ExpiredToken``, as S3 answers) is
signed again, once, with credentials the chain resolved afresh (this process's and the node's shared
copy forgotten first); a second refusal is final, with a message that says so, after exactly 2
requests. Real moto S3 behind a proxy that refuses the tokens it is told are expired; the credentials
come from a profile's ``credential_process`` that counts its runs and hands out a new token each run."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blobdata import AccessDenied, FetchOptions
from blobdata._loop import run
from blobdata._stores import lister_for
from blobdata._stores.s3 import S3Reader, sigv4
from blobdata._stores.s3 import credentials as node_credentials
from blobdata._url import parse_url
from blobdata.testing import LocalS3Server, s3_client
from tests.support.expiring_proxy import ExpiringProxy

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]

_PROCESS = """
import datetime, json, sys
with open(sys.argv[1], "a") as f:
    f.write("ran\\n")
n = len(open(sys.argv[1]).read().splitlines())
later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
print(json.dumps({"Version": 1, "AccessKeyId": f"AKID{n}", "SecretAccessKey": f"secret-{n}",
                  "SessionToken": f"tok-{n}", "Expiration": later.isoformat()}))
"""


@pytest.fixture
def profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A fresh profile whose credential_process counts its runs in the returned file."""
    name = f"bd-{uuid.uuid4().hex[:8]}"
    script, runs = tmp_path / "process.py", tmp_path / "runs.txt"
    script.write_text(_PROCESS)
    config = tmp_path / "config"
    config.write_text(f"[profile {name}]\ncredential_process = {sys.executable} {script} {runs}\n")
    (tmp_path / "credentials").write_text("")
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield name, runs
    for key in [k for k in sigv4.chains if k[1] == name]:
        del sigv4.chains[key]
    path = node_credentials._path(node_credentials.chain_key(name))
    if path is not None:
        for p in (path, path + ".lock"):
            if os.path.exists(p):
                os.unlink(p)


@pytest.fixture
def bucket(verbatim_s3: LocalS3Server) -> str:
    name = f"exp-{uuid.uuid4().hex[:8]}"
    client = s3_client(verbatim_s3)
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key="ds/a.bin", Body=b"hello")
    client.put_object(Bucket=name, Key="ds/b.bin", Body=b"world!")
    return name


def _proxy(server: LocalS3Server, **kwargs: Any) -> ExpiringProxy:
    port = int(server.endpoint_url.rsplit(":", 1)[1].split("/")[0])
    return ExpiringProxy("127.0.0.1", port, **kwargs)


def _options(proxy: ExpiringProxy, profile: str) -> dict[str, Any]:
    return {"endpoint_url": proxy.endpoint_url, "profile": profile,
            "client_kwargs": {"region_name": "us-east-1"}}  # fmt: skip


def _read(options: dict[str, Any], bucket: str, key: str) -> bytes:
    reader = S3Reader(options)

    async def go() -> bytes:
        try:
            return (await reader.read(bucket, key, timeout=30)).body
        finally:
            await reader.close()

    return run(go())


def _runs(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_an_expired_token_is_resolved_again_once_and_the_read_succeeds(
    verbatim_s3: LocalS3Server, bucket: str, profile: tuple[str, Path]
) -> None:
    name, runs = profile
    with _proxy(verbatim_s3, expired={"tok-1"}) as proxy:
        assert _read(_options(proxy, name), bucket, "ds/a.bin") == b"hello"
        assert proxy.tokens == ["tok-1", "tok-2"]  # refused, then signed with what the 2nd run gave
    assert _runs(runs) == 2  # the credential chain was resolved a second time, once
    path = node_credentials._path(node_credentials.chain_key(name))
    if path is not None:  # the node's shared copy holds the new credentials, not the expired ones
        shared = node_credentials._read(path)
        assert shared is not None and shared[0].token == "tok-2"
    # The process signs on with the refreshed credentials: no further resolution.
    with _proxy(verbatim_s3, expired={"tok-1"}) as proxy:
        assert _read(_options(proxy, name), bucket, "ds/b.bin") == b"world!"
        assert proxy.tokens == ["tok-2"]
    assert _runs(runs) == 2


def test_a_listing_refused_as_expired_is_signed_again_with_fresh_credentials(
    verbatim_s3: LocalS3Server, bucket: str, profile: tuple[str, Path]
) -> None:
    name, runs = profile
    with _proxy(verbatim_s3, expired={"tok-1"}) as proxy:
        lister = lister_for(parse_url(f"s3://{bucket}/"), _options(proxy, name), FetchOptions())

        async def go() -> Any:
            try:
                return await lister.below("ds")
            finally:
                await lister.aclose()

        found = run(go())
        assert [(k, size) for k, size, _ in found] == [("ds/a.bin", 5), ("ds/b.bin", 6)]
        assert proxy.tokens[:2] == ["tok-1", "tok-2"] and set(proxy.tokens[1:]) == {"tok-2"}
    assert _runs(runs) == 2


def test_two_expired_tokens_in_a_row_fail_clearly_after_two_requests(
    verbatim_s3: LocalS3Server, bucket: str, profile: tuple[str, Path]
) -> None:
    name, runs = profile
    with _proxy(verbatim_s3, expire_all=True) as proxy:
        with pytest.raises(AccessDenied) as info:
            _read(_options(proxy, name), bucket, "ds/a.bin")
        assert proxy.tokens == ["tok-1", "tok-2"]  # exactly 2 requests, each with its own credentials
    assert _runs(runs) == 2
    msg = str(info.value)
    assert f"s3://{bucket}/ds/a.bin" in msg
    assert "expired and could not be refreshed" in msg and "ExpiredToken" in msg
    assert "secret-" not in msg and "tok-" not in msg  # never the credentials


def test_static_credentials_refused_as_expired_are_not_retried(
    verbatim_s3: LocalS3Server, bucket: str
) -> None:
    with _proxy(verbatim_s3, expired={"static-tok"}) as proxy:
        options = {"endpoint_url": proxy.endpoint_url, "key": "AKIDSTATIC", "secret": "s",
                   "token": "static-tok"}  # fmt: skip
        with pytest.raises(AccessDenied, match="session token given in storage_options"):
            _read(options, bucket, "ds/a.bin")
        assert proxy.tokens == ["static-tok"]

"""The lean S3 GET path (blobdata._s3): SigV4 parity with botocore, keys, errors, identity pinning."""

from __future__ import annotations

import asyncio
import datetime
import pickle
from typing import Any

import botocore.auth
import botocore.config
import botocore.credentials
import botocore.session
import botocore.utils
import pytest
from botocore.awsrequest import AWSRequest

from blobdata._errors import AccessDenied, BlobdataError, NotFound, ObjectChanged
from blobdata._s3 import EMPTY_SHA256, Credentials, S3Reader, SigV4Signer, quote_key, split_identity

TRICKY_KEYS = [
    "plain.bin",
    "with space/and  two.jpg",
    "plus+sign+.png",
    "ünï/日本語/ß.txt",
    "a/../b",
    "..",
    "dots..in..name",
    "a//b",
    "/leading",
    "per%25cent%",
    "q?x=1&y#frag",
    "tilde~star*paren(1)!'",
    "semi;colon:at@comma,eq=dollar$",
]


# -- signer parity ------------------------------------------------------------------------------
def _botocore_auth(
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    headers: dict[str, str],
    *,
    token: str | None,
    region: str,
    when: datetime.datetime,
    unsigned: bool,
) -> dict[str, str]:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *a, **k: when)
    creds = botocore.credentials.Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    request = AWSRequest(method="GET", url=url, headers=dict(headers))
    if unsigned:
        request.context["client_config"] = botocore.config.Config(s3={"payload_signing_enabled": False})
    botocore.auth.S3SigV4Auth(creds, "s3", region).add_auth(request)
    return {k.lower(): v for k, v in request.headers.items()}


@pytest.mark.parametrize("key", TRICKY_KEYS)
@pytest.mark.parametrize(
    ("host", "token", "region", "unsigned", "extra"),
    [
        ("127.0.0.1:9000", None, "us-east-1", False, {}),
        ("s3.eu-west-3.amazonaws.com", "FwoGZXIvYXdzE//session+token==", "eu-west-3", True, {}),
        ("minio.local:9000", None, "auto", False, {"Range": "bytes=0-99", "If-Match": '"abc-3"'}),
    ],
)
def test_signature_matches_botocore(
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    host: str,
    token: str | None,
    region: str,
    unsigned: bool,
    extra: dict[str, str],
) -> None:
    when = datetime.datetime(2026, 2, 28, 23, 59, 58)
    path = f"/my-bucket/{quote_key(key)}"
    scheme = "https" if unsigned else "http"
    expected = _botocore_auth(
        monkeypatch,
        f"{scheme}://{host}{path}",
        extra,
        token=token,
        region=region,
        when=when,
        unsigned=unsigned,
    )
    assert expected["x-amz-content-sha256"] == ("UNSIGNED-PAYLOAD" if unsigned else EMPTY_SHA256)
    signer = SigV4Signer(unsigned_payload=unsigned)
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    ours = signer.sign("GET", host, path, dict(extra), creds, region, amz_date="20260228T235958Z")
    assert ours["Authorization"] == expected["authorization"]
    assert ours["x-amz-date"] == expected["x-amz-date"]
    assert ours["x-amz-content-sha256"] == expected["x-amz-content-sha256"]
    assert ours.get("x-amz-security-token") == expected.get("x-amz-security-token")
    # The signing key is cached: a second request signs identically.
    again = signer.sign("GET", host, path, dict(extra), creds, region, amz_date="20260228T235958Z")
    assert again["Authorization"] == ours["Authorization"]


@pytest.mark.parametrize("key", TRICKY_KEYS)
def test_quote_key_matches_botocore_serializer(key: str) -> None:
    assert quote_key(key) == botocore.utils.percent_encode(key, safe="/~")


def test_quote_key_rules() -> None:
    assert quote_key("a b+c/d~e_f-g.h") == "a%20b%2Bc/d~e_f-g.h"
    assert quote_key("a/../b//c") == "a/../b//c"  # never normalised
    assert quote_key("é") == "%C3%A9"
    assert quote_key("%") == "%25"


def test_split_identity() -> None:
    assert split_identity('"abc"') == ("abc", None)
    assert split_identity("abc-2@v1.x") == ("abc-2", "v1.x")


def test_credentials_never_printed(s3_server: Any) -> None:
    opts = dict(s3_server.storage_options, secret="TOPSECRETVALUE123", token="SESSIONTOKEN456")
    reader = S3Reader(opts)
    creds = Credentials("AKID", "TOPSECRETVALUE123", "SESSIONTOKEN456")
    for text in (repr(reader), repr(creds), str(creds), repr(SigV4Signer())):
        assert "TOPSECRETVALUE123" not in text and "SESSIONTOKEN456" not in text


# -- against the local S3 server ----------------------------------------------------------------
def _client(bucket: Any) -> Any:
    so = bucket.storage_options
    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=so.get("endpoint_url") or so["client_kwargs"]["endpoint_url"],
        aws_access_key_id=so["key"],
        aws_secret_access_key=so["secret"],
        region_name="us-east-1",
    )


def _run(reader: S3Reader, coro: Any) -> Any:
    async def go() -> Any:
        try:
            return await coro
        finally:
            await reader.close()

    return asyncio.run(go())


def _round_trip(client: Any, bucket: str, storage_options: dict[str, Any]) -> set[str]:
    """Store every tricky key the server accepts; each must read back byte-exact, as botocore reads
    it, with the ETag the listing reports. Returns the keys the server stored."""
    stored: dict[str, bytes] = {}
    for i, key in enumerate(TRICKY_KEYS):
        data = f"{i}:{key}".encode() * 50
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data)
        except client.exceptions.ClientError:
            continue  # SeaweedFS refuses '..' segments
        stored[key] = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    listed = {o["Key"]: o["ETag"].strip('"') for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    reader = S3Reader(storage_options, concurrency=4)

    async def read_all() -> list[tuple[bytes, str]]:
        return [await reader.get(bucket, k, timeout=10) for k in stored]

    got = _run(reader, read_all())
    for (key, expected), (body, identity) in zip(stored.items(), got, strict=True):
        assert body == expected, key
        if key in listed:
            assert identity == listed[key], key
    return set(stored)


@pytest.mark.network
def test_tricky_keys_round_trip(s3_bucket: Any) -> None:
    stored = _round_trip(_client(s3_bucket), s3_bucket.name, s3_bucket.storage_options)
    assert {"with space/and  two.jpg", "plus+sign+.png", "ünï/日本語/ß.txt", "q?x=1&y#frag"} <= stored


@pytest.fixture(scope="module")
def moto_server() -> Any:
    from blobdata._servers import LocalS3Server

    with LocalS3Server(backend="moto") as server:
        yield server


@pytest.mark.network
@pytest.mark.slow
def test_tricky_keys_round_trip_verbatim_store(moto_server: Any) -> None:
    """moto keeps '..', '//' and a leading '/' verbatim (SeaweedFS normalises them): all must read back."""
    from blobdata._servers import s3_client

    client = s3_client(moto_server)
    client.create_bucket(Bucket="tricky-keys")
    assert _round_trip(client, "tricky-keys", moto_server.storage_options) == set(TRICKY_KEYS)


@pytest.mark.network
def test_range_and_identity(s3_bucket: Any) -> None:
    data = bytes(range(256)) * 40
    s3_bucket.put("obj.bin", data)
    reader = S3Reader(s3_bucket.storage_options)

    async def go() -> None:
        body, etag = await reader.get(s3_bucket.name, "obj.bin", timeout=10)
        assert body == data and etag and '"' not in etag
        part = await reader.read(
            s3_bucket.name, "obj.bin", start=100, end=1124, expect_identity=etag, timeout=10
        )
        assert part.body == data[100:1124] and part.total == len(data) and part.identity == etag
        assert (await reader.get(s3_bucket.name, "obj.bin", expect_identity=f'"{etag}"', timeout=10))[
            0
        ] == data
        with pytest.raises(ObjectChanged) as info:
            await reader.get(s3_bucket.name, "obj.bin", expect_identity="0123456789abcdef", timeout=10)
        assert f"s3://{s3_bucket.name}/obj.bin" in str(info.value)

    _run(reader, go())


@pytest.mark.network
def test_not_found(s3_bucket: Any) -> None:
    reader = S3Reader(s3_bucket.storage_options)

    async def go() -> None:
        with pytest.raises(FileNotFoundError) as info:
            await reader.get(s3_bucket.name, "missing/key.jpg", timeout=10)
        assert isinstance(info.value, NotFound)
        assert f"s3://{s3_bucket.name}/missing/key.jpg" in str(info.value)
        with pytest.raises(NotFound, match="bucket"):
            await reader.get(s3_bucket.name + "-nope", "k", timeout=10)

    _run(reader, go())


@pytest.mark.network
def test_bad_secret_is_access_denied_without_secret(s3_bucket: Any) -> None:
    s3_bucket.put("k.bin", b"x")
    secret = "WRONG-secret-Value-987654321"
    reader = S3Reader(dict(s3_bucket.storage_options, secret=secret))

    async def go() -> BaseException:
        with pytest.raises(PermissionError) as info:
            await reader.get(s3_bucket.name, "k.bin", timeout=10)
        return info.value

    err = _run(reader, go())
    assert isinstance(err, AccessDenied) and isinstance(err, BlobdataError)
    assert f"s3://{s3_bucket.name}/k.bin" in str(err)
    chain = [err, err.__cause__, err.__context__]
    for e in chain:
        assert secret not in repr(e) and secret not in str(e)
    assert secret.encode() not in pickle.dumps(err)
    assert isinstance(pickle.loads(pickle.dumps(err)), AccessDenied)


@pytest.mark.network
def test_anonymous_request_to_private_bucket_is_refused(s3_bucket: Any) -> None:
    s3_bucket.put("k.bin", b"x")
    opts = {k: v for k, v in s3_bucket.storage_options.items() if k not in ("key", "secret", "token")}
    reader = S3Reader(dict(opts, anon=True))

    async def go() -> None:
        with pytest.raises(AccessDenied):
            await reader.get(s3_bucket.name, "k.bin", timeout=10)

    _run(reader, go())

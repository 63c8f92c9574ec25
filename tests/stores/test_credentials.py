"""Credentials: never logged, never in error messages or reprs, not pickled, resolved once per process.

Each test sets a recognisable secret, captures DEBUG logging of blobdata and of every client library
underneath (s3fs, botocore, aiobotocore, urllib3, azure, gcsfs, google.auth, fsspec, aiohttp), lists,
fetches and fails on purpose with a wrong secret, then searches everything it captured.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blobdata import AccessDenied, BlobdataError, FetchOptions, FolderDataset
from blobdata._fetch import FetchEngine
from blobdata.testing.emulators import AZURITE_KEY
from tests.support.buckets import TestBucket

pytestmark = pytest.mark.network

LOGGERS = (
    "blobdata", "s3fs", "botocore", "aiobotocore", "urllib3", "azure", "gcsfs", "google.auth",
    "google", "fsspec", "aiohttp", "adlfs",
)  # fmt: skip
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 15.0, "attempts": 2}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog at DEBUG for the root logger and every client library's logger."""
    caplog.set_level(logging.DEBUG)
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    yield caplog


def _texts(caplog: pytest.LogCaptureFixture, errors: list[BaseException]) -> list[str]:
    """Every string a user or a log collector could see: messages, arguments, tracebacks, errors."""
    out = [caplog.text]
    for record in caplog.records:
        out.append(record.getMessage())
        out.append(repr(record.args))
        if record.exc_info and record.exc_info[1] is not None:
            out.append(repr(record.exc_info[1]))
    for err in errors:
        seen: set[int] = set()
        cur: BaseException | None = err
        while cur is not None and id(cur) not in seen:  # the whole cause/context chain
            seen.add(id(cur))
            out.extend((str(cur), repr(cur)))
            cur = cur.__cause__ or cur.__context__
    return out


def _assert_absent(secrets: list[str], texts: list[str]) -> None:
    for secret in secrets:
        for text in texts:
            assert secret not in text, f"secret {secret[:4]}... leaked in: {text[:300]!r}"


def _exercise(bucket: TestBucket, good: dict[str, Any], bad: dict[str, Any] | None) -> list[BaseException]:
    """List, fetch, fetch a missing object, and (with ``bad``) list and fetch with a wrong secret."""
    bucket.put_many({"ds/cls/a.png": b"a" * 100, "ds/cls/b.png": b"b" * 200})
    errors: list[BaseException] = []
    ds = FolderDataset(bucket.url("ds"), storage_options=good, loader=lambda f: f.read(), lookahead=0)
    assert [ds[i][0] for i in range(len(ds))] == [b"a" * 100, b"b" * 200]
    assert "***" in repr(ds)
    errors.append(AssertionError(repr(ds)))  # searched like an error text
    protocol = ds.root.split("://", 1)[0]
    engine = FetchEngine(FetchOptions(**FAST), protocol, good)
    errors.extend(
        e for e in engine.fetch_many_sync([(bucket.url("ds/cls/missing.png"), None, None)], timeout=60)
    )
    engine.close()
    if bad is not None:
        with pytest.raises(AccessDenied) as info:
            FolderDataset(bucket.url("ds"), storage_options=bad, refresh=True)
        errors.append(info.value)
        engine = FetchEngine(FetchOptions(**FAST), protocol, bad)
        out = engine.fetch_many_sync([(ds.manifest.url(0), 100, ds.manifest.identity(0))], timeout=60)
        engine.close()
        assert isinstance(out[0], AccessDenied), out[0]
        errors.extend(e for e in out if isinstance(e, BaseException))
    assert all(isinstance(e, (BlobdataError, AssertionError)) for e in errors)
    return errors


def test_s3_secret_never_logged(s3_bucket: TestBucket, debug_logs: pytest.LogCaptureFixture) -> None:
    good = dict(s3_bucket.storage_options)
    wrong = f"WRONG-s3-secret-{uuid.uuid4().hex}"
    errors = _exercise(s3_bucket, good, {**good, "secret": wrong})
    assert any("botocore" in r.name for r in debug_logs.records), "botocore DEBUG logs were not captured"
    _assert_absent([good["secret"], wrong], _texts(debug_logs, errors))


def test_azure_key_never_logged(az_bucket: TestBucket, debug_logs: pytest.LogCaptureFixture) -> None:
    good = dict(az_bucket.storage_options)
    wrong_key = "QUJD" + AZURITE_KEY[4:]
    bad = {"connection_string": good["connection_string"].replace(AZURITE_KEY, wrong_key)}
    errors = _exercise(az_bucket, good, bad)
    assert any(r.name.startswith("azure") for r in debug_logs.records), "azure logs were not captured"
    # The key itself and its longest distinctive piece (a log could cut or re-encode it).
    _assert_absent([AZURITE_KEY, AZURITE_KEY[8:40], wrong_key], _texts(debug_logs, errors))


def test_gcs_token_never_logged(
    gcs_bucket: TestBucket, debug_logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A raw access token: gcsfs would look up its expiry at oauth2.googleapis.com (never contacted here).
    monkeypatch.setenv("FETCH_RAW_TOKEN_EXPIRY", "false")
    token = f"ya29.blobdata-fake-token-{uuid.uuid4().hex}"
    good = {**gcs_bucket.storage_options, "token": token}
    # The emulator checks no credentials, so there is no refusal to provoke; a 404 is the failure.
    errors = _exercise(gcs_bucket, good, None)
    # Listings and reads go through blobdata's own session (gcsfs only resolves the credentials).
    assert any(r.name.startswith("blobdata") for r in debug_logs.records), "blobdata logs were not captured"
    _assert_absent([token], _texts(debug_logs, errors))


def _env_s3(monkeypatch: pytest.MonkeyPatch, server: Any, tmp_path: Path) -> None:
    """S3 credentials and endpoint from the environment only; no config file, no metadata service."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


def test_pickled_dataset_has_no_env_secret_s3(
    s3_server: Any, s3_bucket: TestBucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import blobdata._stores.s3.sigv4

    _env_s3(monkeypatch, s3_server, tmp_path)
    monkeypatch.setattr(blobdata._stores.s3.sigv4, "chains", {})  # resolve the environment's chain afresh
    s3_bucket.put("ds/cls/a.png", b"abc")
    ds = FolderDataset(s3_bucket.url("ds"), loader=lambda f: f.read(), lookahead=0)
    assert ds[0][0] == b"abc"  # the per-process engine exists and has used the credentials
    blob = pickle.dumps(_picklable(ds))
    assert s3_server.secret_key.encode() not in blob
    assert s3_server.secret_key not in repr(ds)
    ds.close()


def test_pickled_dataset_has_no_env_secret_azure(
    az_bucket: TestBucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", az_bucket.storage_options["connection_string"])
    az_bucket.put("ds/cls/a.png", b"abc")
    ds = FolderDataset(az_bucket.url("ds"), loader=lambda f: f.read(), lookahead=0)
    assert ds[0][0] == b"abc"
    blob = pickle.dumps(_picklable(ds))
    assert AZURITE_KEY.encode() not in blob and AZURITE_KEY[8:40].encode() not in blob
    assert AZURITE_KEY[8:40] not in repr(ds)
    ds.close()


def _read(f: Any) -> bytes:
    data: bytes = f.read()
    return data


def _picklable(ds: FolderDataset) -> FolderDataset:
    """The dataset as spawn workers receive it (the test's lambda loader replaced by a function)."""
    ds.loader = _read
    return ds


# ------------------------------------------------------------------ resolved once per process

_COUNT_S3 = r"""
import json, sys
import aiobotocore.credentials, botocore.credentials
calls = {"botocore": 0, "aiobotocore": 0}
orig, aorig = botocore.credentials.CredentialResolver.load_credentials, \
    aiobotocore.credentials.AioCredentialResolver.load_credentials
def counted(self):
    calls["botocore"] += 1
    return orig(self)
async def acounted(self):
    calls["aiobotocore"] += 1
    return await aorig(self)
botocore.credentials.CredentialResolver.load_credentials = counted
aiobotocore.credentials.AioCredentialResolver.load_credentials = acounted
from blobdata import FetchOptions, FolderDataset
from blobdata._fetch import FetchEngine
url = sys.argv[1]
# Cold start: 24 reads, 8 in flight, before anything else in this process resolved credentials.
engine = FetchEngine(FetchOptions(concurrency=8), "s3", {})
out = engine.fetch_many_sync([(f"{url}/c{i % 3}/{i}.png", None, None) for i in range(24)], timeout=120)
assert all(isinstance(o, bytes) for o in out), out
engine.close()
for refresh in (False, True):  # two datasets, two listings
    ds = FolderDataset(url, loader=lambda f: f.read(), lookahead=0, refresh=refresh,
                       fetch_options=FetchOptions(concurrency=8))
    got = ds.__getitems__(list(range(len(ds))))
    assert len(got) == len(ds) == 24, len(got)
    ds.close()
print(json.dumps(calls))
"""

_COUNT_GCS = r"""
import json, sys
import gcsfs.credentials
calls = {"gcsfs": 0}
orig = gcsfs.credentials.GoogleCredentials.__init__
def counted(self, *a, **k):
    calls["gcsfs"] += 1
    orig(self, *a, **k)
gcsfs.credentials.GoogleCredentials.__init__ = counted
from blobdata import FetchOptions, FolderDataset
url, endpoint = sys.argv[1], sys.argv[2]
for refresh in (False, True):
    ds = FolderDataset(url, loader=lambda f: f.read(), lookahead=0, refresh=refresh,
                       storage_options={"endpoint_url": endpoint, "token": "anon"},
                       fetch_options=FetchOptions(concurrency=8))
    got = ds.__getitems__(list(range(len(ds))))
    assert len(got) == len(ds) == 24, len(got)
    ds.close()
print(json.dumps(calls))
"""


def _run_child(code: str, args: list[str], env: dict[str, str]) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])
    return counts


def test_s3_credentials_resolved_once_per_process(
    s3_server: Any, s3_bucket: TestBucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """72 fetches (24 of them at a cold start) and 2 listings resolve the environment's chain once."""
    _env_s3(monkeypatch, s3_server, tmp_path)
    s3_bucket.put_many({f"ds/c{i % 3}/{i}.png": b"x" * (i + 1) for i in range(24)})
    counts = _run_child(_COUNT_S3, [s3_bucket.url("ds")], dict(os.environ))
    # At most once for the signed-GET reader (botocore's chain) and once for s3fs's listing client,
    # however many requests start at once (8 in flight here).
    assert counts["botocore"] + counts["aiobotocore"] >= 1, counts
    assert counts["botocore"] <= 1 and counts["aiobotocore"] <= 1, counts


def test_gcs_credentials_resolved_once_per_process(
    gcs_emulator: Any, gcs_bucket: TestBucket, tmp_path: Path
) -> None:
    """Listing and reading share one gcsfs credential resolution per process."""
    gcs_bucket.put_many({f"ds/c{i % 3}/{i}.png": b"x" * (i + 1) for i in range(24)})
    env = {**os.environ, "BLOBDATA_CACHE_HOME": str(tmp_path / "home")}
    counts = _run_child(_COUNT_GCS, [gcs_bucket.url("ds"), gcs_emulator.endpoint_url], env)
    assert counts == {"gcsfs": 1}, counts

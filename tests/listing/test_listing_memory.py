"""Remembered bucket listings: announced, bounded in age, one per URL and endpoint, replaced when corrupt."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from blobdata._listing import load_or_list

pytestmark = pytest.mark.network


def _tree(bucket: Any) -> None:
    bucket.put_many({f"ds/c{i % 2}/{i}.png": b"x" for i in range(4)})


def _remembered(home: Any) -> list[Path]:
    return list(Path(home).rglob("*.manifest"))


def test_remembered_listing_is_announced_with_its_age(
    s3_bucket: Any, isolated_cache_home: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _tree(s3_bucket)
    url = s3_bucket.url("ds")
    first = load_or_list(url, storage_options=s3_bucket.storage_options)
    (stored,) = _remembered(isolated_cache_home)
    assert oct(stored.stat().st_mode & 0o777) == oct(0o600)
    s3_bucket.put("ds/c0/added.png", b"y")
    with caplog.at_level(logging.INFO, logger="blobdata"):
        again = load_or_list(url, storage_options=s3_bucket.storage_options)
    assert len(again) == len(first)  # remembered: the new object is not seen...
    said = [r.getMessage() for r in caplog.records if "remembered listing" in r.getMessage()]
    assert said and url in said[0] and "ago" in said[0] and "refresh=True" in said[0]  # ...and it says so
    assert len(load_or_list(url, storage_options=s3_bucket.storage_options, refresh=True)) == len(first) + 1


def test_a_reused_listing_is_one_warning_per_process_with_its_age(
    s3_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40: a listing reused hides what was uploaded since, and was said at INFO only: the first
    loop with one's own data (upload, run, fix, upload again) met it silently."""
    from blobdata import BlobDataset

    _tree(s3_bucket)
    s3_bucket.put_many({f"flat/{i}.txt": b"x" for i in range(3)})
    url, flat, opts = s3_bucket.url("ds"), s3_bucket.url("flat"), s3_bucket.storage_options
    load_or_list(url, storage_options=opts)
    BlobDataset(flat, storage_options=opts, share_listing=False)
    with caplog.at_level(logging.INFO, logger="blobdata"):
        for _ in range(3):
            load_or_list(url, storage_options=opts)
            BlobDataset(flat, storage_options=opts, share_listing=False)
    said = [r for r in caplog.records if "remembered listing" in r.getMessage()]
    warned = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert len(said) == 6 and len(warned) == 2, [r.getMessage() for r in said]  # once per listing
    for root, message in zip((url, flat), warned, strict=True):
        assert message.startswith(f"using the remembered listing of {root}, made 0 s ago"), message
        assert "uploaded, changed or removed since are not in it" in message and "refresh=True" in message


def test_listing_max_age(s3_bucket: Any, isolated_cache_home: Any) -> None:
    _tree(s3_bucket)
    url = s3_bucket.url("ds")
    first = load_or_list(url, storage_options=s3_bucket.storage_options)
    (stored,) = _remembered(isolated_cache_home)
    s3_bucket.put("ds/c1/added.png", b"y")
    assert len(load_or_list(url, storage_options=s3_bucket.storage_options, max_age="1h")) == len(first)
    old = time.time() - 2 * 3600
    # The age is the listing's own time, not the file's: rewrite the manifest as listed 2 h ago.
    from blobdata._listing import Manifest

    m = Manifest.load(stored)
    m.listed_at = old
    m.save(stored)
    assert len(load_or_list(url, storage_options=s3_bucket.storage_options, max_age="1h")) == len(first) + 1
    assert len(load_or_list(url, storage_options=s3_bucket.storage_options, max_age=None)) == len(first) + 1


def test_one_remembered_listing_per_url_and_endpoint_not_per_credential_source(
    s3_bucket: Any, isolated_cache_home: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _tree(s3_bucket)
    url = s3_bucket.url("ds")
    opts = s3_bucket.storage_options
    load_or_list(url, storage_options=opts)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    from_env = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    s3_bucket.put("ds/c0/added.png", b"y")
    # Before: the environment's credentials made another listing (65 samples vs 60).
    assert len(load_or_list(url, storage_options=from_env)) == 4
    assert len(_remembered(isolated_cache_home)) == 1
    other_endpoint = {**opts, "endpoint_url": opts["endpoint_url"].replace("127.0.0.1", "localhost")}
    assert len(load_or_list(url, storage_options=other_endpoint)) == 5
    assert len(_remembered(isolated_cache_home)) == 2


def test_corrupt_remembered_listing_is_replaced(
    s3_bucket: Any, isolated_cache_home: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _tree(s3_bucket)
    url = s3_bucket.url("ds")
    load_or_list(url, storage_options=s3_bucket.storage_options)
    (stored,) = _remembered(isolated_cache_home)
    s3_bucket.put("ds/c0/added.png", b"y")
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    os.chmod(stored, 0o600)
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        again = load_or_list(url, storage_options=s3_bucket.storage_options)
    assert len(again) == 5
    assert any("unusable" in r.getMessage() for r in caplog.records)

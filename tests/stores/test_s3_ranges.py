"""One S3 prefix listed in key ranges at once gives the very list a page-by-page listing gives (keys,
order, sizes, ETags), on SeaweedFS (which orders by path segment) and moto (S3's byte order), with
keys that make the split strings awkward; and the ranges really run in parallel where the store
follows S3's order."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import blobdata._stores.s3.listing as s3_listing
from blobdata import FetchOptions
from blobdata._loop import run
from blobdata._stores import lister_for
from blobdata._stores.s3 import ranges as ranges_mod
from blobdata._url import parse_url

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

PAGE = 25  # keys per page here, so that a few hundred keys make many pages and ranges


def _keys(n: int) -> dict[str, bytes]:
    """Numbered keys with uneven widths, a gap, spaces, '+', unicode, nested folders and a long tail."""
    keys = {f"ds/big/img_{i:05d}.jpg": b"x" * (i % 7) for i in range(n)}
    keys.update({f"ds/big/img_{i}.png": b"yy" for i in range(0, n, 37)})  # other widths
    keys.update({f"ds/big/zz gap {i} +.jpg": b"z" for i in range(40)})  # far away in the key space
    keys.update({f"ds/big/日本{i}.jpg": b"u" for i in range(30)})
    keys.update({f"ds/big/sub/{i:03d}.jpg": b"s" for i in range(30)})
    keys["ds/big/~last"] = b"t"
    keys["ds/other/not-listed.jpg"] = b"o"
    return keys


def _list(url: str, storage_options: Any, concurrency: int) -> list[tuple[str, int, str]]:
    lister = lister_for(parse_url(url), storage_options, FetchOptions(concurrency=concurrency))
    assert isinstance(lister, s3_listing.S3LeanLister)

    async def go() -> list[tuple[str, int, str]]:
        try:
            return await lister.below("big")
        finally:
            await lister.aclose()

    return run(go())


def _compare(bucket: str, storage_options: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Both listings of s3://bucket/ds/big; returns the start-after values the ranges sent."""
    monkeypatch.setattr(s3_listing, "_PAGE_KEYS", PAGE)
    sent: list[str] = []
    real = ranges_mod.list_page_after

    async def recording(reader: Any, bkt: str, prefix: str, start_after: str, **kw: Any) -> Any:
        sent.append(start_after)
        return await real(reader, bkt, prefix, start_after, **kw)

    monkeypatch.setattr(s3_listing, "list_page_after", recording)
    url = f"s3://{bucket}/ds"
    sequential = _list(url, storage_options, concurrency=1)
    assert not sent  # one range: page by page
    parallel = _list(url, storage_options, concurrency=16)
    assert parallel == sequential
    assert len(sequential) == len({k for k, _, _ in sequential}) > 400
    return sent


def test_ranges_equal_the_page_by_page_listing_on_moto(
    verbatim_s3: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from blobdata.testing import s3_client

    client = s3_client(verbatim_s3)
    client.create_bucket(Bucket="ranges")
    for key, data in _keys(400).items():
        client.put_object(Bucket="ranges", Key=key, Body=data)
    with caplog.at_level(logging.INFO, logger="blobdata"):
        sent = _compare("ranges", verbatim_s3.storage_options, monkeypatch)
    assert len(sent) >= 4  # ranges ran, and their result was kept (no page-by-page fallback)
    assert not [r for r in caplog.records if "page by page instead" in r.getMessage()]


def test_ranges_equal_the_page_by_page_listing_on_the_suites_server(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_bucket.put_many(_keys(400))
    _compare(s3_bucket.name, s3_bucket.storage_options, monkeypatch)


def test_split_strings_increase_and_stay_valid() -> None:
    space = ranges_mod._Space(["img_00001.jpg", "img_00999.jpg", "日本.jpg"])
    last = ""
    v = space.value("img_00001.jpg")
    for step in range(1, 200):
        s = space.string(v + step * 10**6)
        assert s is not None and s > last
        s.encode("utf-8")  # no surrogate: it can be sent
        last = s
    top = 1
    for i in range(len(space.alphabets)):
        top *= space._radix(i)
    assert space.string(top) is None  # past every string of that length
    numbered = ranges_mod._Space([f"img_{i:05d}.jpg" for i in range(1000)])
    base = numbered.value("img_00999.jpg")
    step = (base - numbered.value("img_00000.jpg")) // 999
    assert numbered.string(base + step) == "img_01000.jpg"  # numbered names count in decimal
    assert numbered.string(base - numbered.value("img_00000.jpg") + base) == "img_01998.jpg"

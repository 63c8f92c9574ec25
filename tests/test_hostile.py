"""Never trust the server: blobdata's S3 client against ``blobdata.testing.HostileServer``.

Each test is one finding of issue #21 (numbered as there): what a misbehaving store, gateway or
proxy sends, and what blobdata must do instead of believing it. The server runs in-process on
127.0.0.1 (an in-memory store), so these tests start no server process.
"""

from __future__ import annotations

import logging
import os
import re
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from blobdata import FolderDataset
from blobdata._config import FetchOptions
from blobdata._errors import FetchError, FetchTimeout, ManifestError, ObjectChanged
from blobdata._fetch import FetchEngine
from blobdata._listing import list_folder
from blobdata._stores.s3 import S3Reader
from blobdata.testing import HostileServer

pytestmark = pytest.mark.timeout(60)

SIZE = 200_000
PART = 64 * 1024


@pytest.fixture
def store() -> Iterator[HostileServer]:
    with HostileServer() as server:
        yield server


def _fetch(store: HostileServer, key: str, *, size: int | None, identity: str | None = None, **opts: Any,
           ) -> Any:  # fmt: skip
    """One fetch of ``s3://data/key`` through a fresh engine, one attempt: the bytes or the error."""
    options = FetchOptions(**{"attempts": 1, "timeout": 5, "part_size": PART, **opts})
    engine = FetchEngine(options, "s3", store.storage_options)
    try:
        return engine.fetch_many_sync([(f"s3://data/{key}", size, identity)])[0]
    finally:
        engine.close()


def _peak(fn: Any) -> tuple[Any, int]:
    """(fn(), the peak of traced Python memory during it, in bytes above the start)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# -- wrong bytes delivered as success ------------------------------------------------------------
def test_1_a_part_of_another_range_is_refused(store: HostileServer) -> None:
    data = os.urandom(SIZE)
    etag = store.put("data", "big.bin", data)
    assert _fetch(store, "big.bin", size=SIZE, identity=etag) == data  # honest: parts reassembled
    store.mode = "wrong_range"
    got = _fetch(store, "big.bin", size=SIZE, identity=etag)
    assert isinstance(got, FetchError), "a part from the wrong offset was taken as the range asked"
    # Whichever part failed first is named with the range it got and the one it asked for.
    wrong = r"Content-Range 'bytes \d+-\d+/200000' with \d+ bytes, but bytes \d+-\d+ was asked"
    assert re.search(wrong, str(got)), got


def test_2_a_pinned_read_without_etag_is_not_a_match(store: HostileServer) -> None:
    listed = store.put("data", "a.bin", b"v1" * 50_000)
    store.put("data", "a.bin", b"v2" * 50_000)  # replaced after the listing, same size
    store.mode = "no_etag"  # a proxy that ignores If-Match and drops the ETag
    for size in (100_000, 30_000):  # a whole read and, with a smaller listed size, ranged parts
        got = _fetch(store, "a.bin", size=100_000, identity=listed, part_size=max(size, PART))
        assert isinstance(got, ObjectChanged), f"bytes of another version returned: {got!r:.80}"
        assert "no ETag" in str(got)


def test_3_transfer_codings_but_chunked_are_refused(store: HostileServer) -> None:
    store.put("data", "a.txt", b"hello " * 1000)
    store.mode = "gzip_chunked"
    got = _fetch(store, "a.txt", size=None)  # size unknown: the body's length is not checked after
    assert isinstance(got, FetchError), f"gzip bytes returned as the object: {got!r:.60}"
    assert "Transfer-Encoding" in str(got)


# -- memory a server decides ---------------------------------------------------------------------
def test_4_a_huge_content_length_is_refused_before_any_buffer(store: HostileServer) -> None:
    store.put("data", "a.bin", os.urandom(100_000))
    store.mode = "huge_length"
    store.huge_length = 200_000_000
    got, peak = _peak(lambda: _fetch(store, "a.bin", size=100_000))
    assert isinstance(got, FetchError) and "Content-Length 200000000" in str(got), got
    assert peak < 20_000_000, f"{peak} bytes allocated for a 100 KB object"
    for huge in (10**13, 10**20):  # past any memory: a clear error, not a "Fatal error" in asyncio
        store.huge_length = huge
        got = _fetch(store, "a.bin", size=100_000)
        assert isinstance(got, FetchError) and "Content-Length" in str(got), got


@pytest.mark.parametrize("mode", ["endless_chunked", "endless_body"])
def test_5_endless_bodies_stop_at_what_was_asked(store: HostileServer, mode: Any) -> None:
    store.put("data", "a.bin", os.urandom(100_000))
    store.mode = mode
    got, peak = _peak(lambda: _fetch(store, "a.bin", size=100_000, timeout=4, part_size="1MiB"))
    assert isinstance(got, FetchError) and not isinstance(got, FetchTimeout), got
    assert "100000 bytes asked" in str(got)
    assert peak < 20_000_000


def test_6_a_200_to_ranged_parts_is_read_once(store: HostileServer) -> None:
    size = 2 * 1024 * 1024  # 32 parts of 64 KiB
    data = os.urandom(size)
    etag = store.put("data", "big.bin", data)
    store.mode = "range_ignored"
    store.body_delay_s = 0.003  # a pause every 64 KiB, as a store at a distance
    assert _fetch(store, "big.bin", size=size, identity=etag) == data
    # Every part got a 200 with the whole object: each was dropped at its head, then one whole read.
    # (Reading every 200 to its end would send 32 x 2 MiB.)
    assert store.bytes_sent < 4 * size, f"{store.bytes_sent / size:.1f}x the object was sent"


# -- loops a server controls ---------------------------------------------------------------------
def _tree(store: HostileServer, n: int = 3) -> None:
    for cls in ("cat", "dog"):
        for i in range(n):
            store.put("data", f"train/{cls}/{i}.jpg", b"x" * 10)


@pytest.mark.parametrize("mode", ["endless_listing", "fresh_tokens"])
def test_7_listings_whose_tokens_go_round_end(store: HostileServer, mode: Any) -> None:
    _tree(store)
    store.mode = mode
    options = FetchOptions(attempts=1, timeout=5)
    with pytest.raises(FetchError) as info:
        list_folder("s3://data/train", storage_options=store.storage_options, fetch_options=options)
    assert "s3://data/train" in str(info.value)
    assert len(store.requests) < 10  # the second or third page gave it away


def test_7_a_listing_has_a_deadline(store: HostileServer) -> None:
    for i in range(2500):  # three pages, each slow
        store.put("data", f"train/cat/{i:05d}.jpg", b"x")
    store.body_delay_s = 0.4
    options = FetchOptions(attempts=1, timeout=30, listing_timeout=0.5)
    with pytest.raises(FetchTimeout) as info:
        list_folder("s3://data/train", storage_options=store.storage_options, fetch_options=options)
    assert "listing_timeout=0.5s" in str(info.value)


def test_8_keys_outside_the_prefix_are_dropped_with_a_warning(
    store: HostileServer, caplog: pytest.LogCaptureFixture
) -> None:
    _tree(store)
    store.mode = "outside_prefix"
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        m = list_folder("s3://data/train", storage_options=store.storage_options)
    assert m.classes == ["cat", "dog"] and len(m) == 6
    expected = [f"{c}/{i}.jpg" for c in ("cat", "dog") for i in range(3)]
    assert sorted(m.relkey(i) for i in range(len(m))) == expected
    warned = [r.getMessage() for r in caplog.records if "outside the requested prefix" in r.getMessage()]
    assert len(warned) == 1 and "s3://data/other/secret/x.jpg" in warned[0]


def test_8_an_impossible_size_is_a_manifest_error_naming_the_key(store: HostileServer) -> None:
    _tree(store)
    store.mode = "huge_size"
    with pytest.raises(ManifestError) as info:
        list_folder("s3://data/train", storage_options=store.storage_options)
    assert "s3://data/train/cat/0.jpg" in str(info.value) and "10000000000" in str(info.value)


# -- credentials in URLs, the head's limits ------------------------------------------------------
def test_12_credentials_in_the_endpoint_are_redacted(store: HostileServer) -> None:
    _tree(store)
    opts = {**store.storage_options, "endpoint_url": f"http://admin:hunter2@127.0.0.1:{store.port}"}
    ds = FolderDataset("s3://data/train", storage_options=opts)
    reader = S3Reader(opts)
    for text in (repr(ds), repr(reader)):
        assert "hunter2" not in text and "admin" not in text and "***@127.0.0.1" in text, text
    with pytest.raises(Exception) as info:
        S3Reader({"endpoint_url": "ftp://admin:hunter2@host"})
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("mode", ["long_header", "lf_only", "bare_cr"])
def test_13_a_bad_head_fails_at_once(store: HostileServer, mode: Any) -> None:
    store.put("data", "a.bin", b"abc")
    store.mode = mode
    got = _fetch(store, "a.bin", size=3, timeout=5)
    # Refused when read: not taken as a response, and not left waiting for the deadline.
    assert isinstance(got, FetchError) and not isinstance(got, FetchTimeout), got
    assert "bad HTTP response" in str(got)

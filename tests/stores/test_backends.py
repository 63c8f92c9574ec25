"""One backend-independent suite, run against every store: memory://, local files, S3, GCS and Azure.

``any_bucket`` (``conftest.py``) is a fresh bucket on each store in turn: S3 is the suite's S3
server, GCS the gcp-storage-emulator (gcsfs lists, :class:`~blobdata._stores.gcs.GCSReader` reads),
Azure is Azurite (adlfs lists, :class:`~blobdata._stores.azure.AzureReader` reads). A store whose
server cannot run is skipped with the reason, and so is a check a store cannot support (the
reason says why). memory:// and file:// need no server: ``-m "not network"`` runs them alone.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from blobdata import AccessDenied, FetchError, FetchOptions, FolderDataset, NotFound, ObjectChanged, Throttled
from blobdata._cache import BlobCache
from blobdata._fetch import FetchEngine
from blobdata._listing import list_folder
from blobdata._loop import run
from blobdata._url import parse_url
from blobdata.testing import FaultMode, LatencyProxy
from blobdata.testing.emulators import AZURITE_KEY
from tests.support import buckets
from tests.support.buckets import TestBucket

CLOUD = {"s3", "gs", "az"}
FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 15.0, "attempts": 2}


def _protocol(bucket: TestBucket) -> str:
    return parse_url(bucket.url()).protocol


def _norm(url: str) -> str:
    """The URL as blobdata writes it (``memory:///x``, ``file:///x``), for comparisons."""
    return str(parse_url(url))


def _png(seed: int, size: tuple[int, int] = (7, 5)) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _bytes_loader(f: Any) -> bytes:
    data: bytes = f.read()
    return data


def _engine(bucket: TestBucket, **options: Any) -> FetchEngine:
    return FetchEngine(FetchOptions(**{**FAST, **options}), _protocol(bucket), bucket.storage_options)


def _fetch(engine: FetchEngine, url: str, **kw: Any) -> tuple[bytes, str]:
    async def go() -> tuple[bytes, str]:
        return await engine.fetch(url, **kw)

    return run(go(), 120)


# Keys exercising ImageFolder's order: nested folders, mixed-case extensions, non-images, unicode,
# spaces and '+', a sibling folder name that sorts differently as a path ("b" vs "b-x").
TREE = [
    "cat/1.jpg",
    "cat/10.JPG",
    "cat/2.png",
    "cat/notes.txt",
    "cat/b/inner.png",
    "cat/b-x/inner2.png",
    "cat/b/deeper/z.PNG",
    "dog/a b+c.png",
    "dog/ünï cödé.png",
    "dog/README",
    "root-level.png",
]
# torchvision.datasets.ImageFolder's order for TREE: classes sorted, then sorted(os.walk()) with
# sorted file names in each directory.
EXPECTED = [
    ("cat/1.jpg", 0),
    ("cat/10.JPG", 0),
    ("cat/2.png", 0),
    ("cat/b/inner.png", 0),
    ("cat/b-x/inner2.png", 0),  # "cat/b-x" sorts before "cat/b/deeper" ('-' < '/')
    ("cat/b/deeper/z.PNG", 0),
    ("dog/a b+c.png", 1),
    ("dog/ünï cödé.png", 1),
]


def _put_tree(bucket: TestBucket) -> dict[str, bytes]:
    tree = {
        f"ds/{k}": (_png(n) if k.lower().endswith((".png", ".jpg")) else b"x") for n, k in enumerate(TREE)
    }
    bucket.put_many(tree)
    return tree


# ------------------------------------------------------------------------------------- listing


def test_listing_has_imagefolder_order(any_bucket: TestBucket) -> None:
    _put_tree(any_bucket)
    root = any_bucket.url("ds")
    ds = FolderDataset(root, storage_options=any_bucket.storage_options, lookahead=0)
    assert ds.classes == ["cat", "dog"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1}
    prefix = ds.url if any_bucket.scheme != "file" else ds.url[len("file://") :]
    got = [(path[len(prefix) + 1 :], t) for path, t in ds.samples]
    assert got == [(k, t) for k, t in EXPECTED]
    assert list(ds.targets) == [t for _, t in EXPECTED]


def test_manifest_is_remembered(any_bucket: TestBucket) -> None:
    """The second construction reads the remembered listing of a bucket: an object added since is not
    seen. Local folders are listed afresh every time, as ImageFolder lists them."""
    _put_tree(any_bucket)
    root = any_bucket.url("ds")
    first = FolderDataset(root, storage_options=any_bucket.storage_options, lookahead=0)
    any_bucket.put("ds/cat/added-later.png", _png(99))
    second = FolderDataset(root, storage_options=any_bucket.storage_options, lookahead=0)
    if any_bucket.scheme in ("memory", "file"):
        # memory:// lives and dies with the process; a local folder costs a directory walk.
        assert len(second) == len(first) + 1
        return
    assert len(second) == len(first)
    assert [s for s in second.samples] == [s for s in first.samples]
    refreshed = FolderDataset(root, storage_options=any_bucket.storage_options, lookahead=0, refresh=True)
    assert len(refreshed) == len(first) + 1


# ------------------------------------------------------------------------------------ fetching


def test_fetch_whole_objects(any_bucket: TestBucket) -> None:
    tree = _put_tree(any_bucket)
    root = any_bucket.url("ds")
    raw = FolderDataset(root, storage_options=any_bucket.storage_options, loader=_bytes_loader, lookahead=0)
    for i, (key, _t) in enumerate(EXPECTED):
        data, target = raw[i]
        assert data == tree[f"ds/{key}"]
        assert target == EXPECTED[i][1]
    images = FolderDataset(root, storage_options=any_bucket.storage_options, lookahead=0)
    batch = images.__getitems__(list(range(len(images))))
    for (img, _t), (key, _) in zip(batch, EXPECTED, strict=True):
        expected = Image.open(io.BytesIO(tree[f"ds/{key}"])).convert("RGB")
        assert img.mode == "RGB"
        assert np.array_equal(np.asarray(img), np.asarray(expected))


def test_range_reads_are_byte_exact_and_identity_agrees(any_bucket: TestBucket) -> None:
    """A ~1 MiB object read as 64 KiB parts; the identity readers report equals the listing's."""
    data = os.urandom(1024 * 1024 + 123)
    any_bucket.put("big/cls/obj.bin", data)
    any_bucket.put("big/cls/small.bin", b"small object")
    opts = any_bucket.storage_options
    manifest = list_folder(any_bucket.url("big"), storage_options=opts, extensions=(".bin",))
    i = [manifest.url(j) for j in range(len(manifest))].index(_norm(any_bucket.url("big/cls/obj.bin")))
    url, size, identity = manifest.url(i), manifest.size(i), manifest.identity(i)
    assert size == len(data) and identity
    engine = _engine(any_bucket, part_size="64KiB")
    try:
        body, got = _fetch(engine, url, size=size, identity=identity)
        assert body == data and got == identity
        assert engine.stats()["requests"] == 17  # ceil((1 MiB + 123) / 64 KiB) parts
        body, got = _fetch(engine, url, size=size)  # unpinned: the first part fixes the identity
        assert body == data
        if any_bucket.scheme in CLOUD:
            # The same object version has the same identity string, listed or read.
            assert got == identity
            assert _fetch(engine, url)[1] == identity
            small = manifest.url(1 - i)
            assert _fetch(engine, small)[1] == manifest.identity(1 - i)
    finally:
        engine.close()


# --------------------------------------------------------------------------------- cache identity


def test_overwritten_object_is_a_cache_miss(any_bucket: TestBucket, tmp_path: Path) -> None:
    any_bucket.put("c/cls/a.png", b"version one")
    root = any_bucket.url("c")
    cache_dir = tmp_path / "cache"
    opts = {"storage_options": any_bucket.storage_options, "loader": _bytes_loader, "lookahead": 0}
    old = FolderDataset(root, cache=cache_dir, **opts)  # type: ignore[arg-type]
    assert old[0][0] == b"version one"
    old.close()
    url, old_identity = old.manifest.url(0), old.manifest.identity(0)
    with BlobCache(cache_dir) as cache:
        assert cache.get(url, old_identity) == b"version one"

    any_bucket.put("c/cls/a.png", b"version two, longer")  # another size: local mtimes can tie
    new = FolderDataset(root, cache=cache_dir, refresh=True, **opts)  # type: ignore[arg-type]
    new_identity = new.manifest.identity(0)
    assert new.manifest.url(0) == url and new_identity != old_identity
    with BlobCache(cache_dir) as cache:
        assert cache.get(url, new_identity) is None  # a miss: the old entry does not answer
    assert new[0][0] == b"version two, longer"
    new.close()
    with BlobCache(cache_dir) as cache:
        deadline = time.monotonic() + 10.0  # the cache write completes in the background
        while cache.get(url, new_identity) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cache.get(url, new_identity) == b"version two, longer"


# ------------------------------------------------------------------------------------------ errors


def test_missing_object_is_not_found_with_its_url(any_bucket: TestBucket) -> None:
    any_bucket.put("e/cls/a.png", b"x")
    engine = _engine(any_bucket)
    try:
        missing = any_bucket.url("e/cls/missing.png")
        out = engine.fetch_many_sync([(missing, None, None), (missing, 1, "123")], timeout=60)
        for err in out:
            assert isinstance(err, NotFound), err
            assert _norm(str(err.url)) == _norm(missing) and str(err.url) in str(err)
    finally:
        engine.close()


def test_missing_bucket_is_not_found(any_bucket: TestBucket) -> None:
    other = buckets.unique_name("missing")
    url = any_bucket.url("x").replace(os.path.basename(any_bucket.name), other, 1)
    assert other in url
    with pytest.raises(NotFound) as info:
        FolderDataset(url, storage_options=any_bucket.storage_options)
    assert other in str(info.value)
    engine = _engine(any_bucket)
    try:
        out = engine.fetch_many_sync([(url + "/cls/a.png", None, None)], timeout=60)
        assert isinstance(out[0], NotFound) and other in str(out[0])
    finally:
        engine.close()


def _bad_credentials(bucket: TestBucket) -> dict[str, Any]:
    kind = bucket.scheme
    if kind in ("memory", "file"):
        pytest.skip(f"{kind}:// has no credentials to refuse")
    if kind == "gs":
        pytest.skip("gcp-storage-emulator accepts any credentials (it checks no Authorization header)")
    if kind == "s3":
        return {**bucket.storage_options, "secret": "wrong-secret-for-the-test"}
    wrong_key = "QUJD" + AZURITE_KEY[4:]  # same length, still base64, not the account's key
    conn = bucket.storage_options["connection_string"].replace(AZURITE_KEY, wrong_key)
    assert conn != bucket.storage_options["connection_string"]
    return {"connection_string": conn}


def test_bad_credentials_are_access_denied(any_bucket: TestBucket) -> None:
    any_bucket.put("d/cls/a.png", b"x")
    bad = _bad_credentials(any_bucket)
    with pytest.raises(AccessDenied):
        FolderDataset(any_bucket.url("d"), storage_options=bad, refresh=True)
    good = FolderDataset(any_bucket.url("d"), storage_options=any_bucket.storage_options)
    engine = FetchEngine(FetchOptions(**FAST), _protocol(any_bucket), bad)
    try:
        out = engine.fetch_many_sync([(good.manifest.url(0), 1, good.manifest.identity(0))], timeout=60)
        assert isinstance(out[0], AccessDenied), out[0]
        assert good.manifest.url(0) in str(out[0])
    finally:
        engine.close()


@pytest.mark.parametrize("same_size", [False, True], ids=["resized", "same-size"])
def test_object_overwritten_after_listing_is_object_changed(any_bucket: TestBucket, same_size: bool) -> None:
    small, big = b"0123456789", os.urandom(300 * 1024)
    any_bucket.put_many({"o/cls/small.png": small, "o/cls/big.png": big})
    ds = FolderDataset(
        any_bucket.url("o"),
        storage_options=any_bucket.storage_options,
        loader=_bytes_loader,
        lookahead=0,
        fetch_options=FetchOptions(part_size="64KiB", **FAST),
    )
    if same_size and any_bucket.scheme == "memory":
        pytest.skip("memory:// reads do not verify the identity; only a size change is detected there")
    if same_size:
        any_bucket.put_many({"o/cls/small.png": b"9876543210", "o/cls/big.png": os.urandom(len(big))})
    else:
        any_bucket.put_many({"o/cls/small.png": small + b"!", "o/cls/big.png": big + b"!"})
    # big.png is read in five ranged parts, small.png in one request. A grown object read in parts
    # is only caught where the reader reports the total size or the identity (not on memory://).
    checked = [1] if any_bucket.scheme == "memory" else range(len(ds))
    assert ds.manifest.url(1).endswith("small.png")
    for i in checked:
        with pytest.raises(ObjectChanged) as info:
            ds[i]
        assert ds.manifest.url(i) in str(info.value)


# ----------------------------------------------------------------------------------------- retries


@contextlib.contextmanager
def _proxied(bucket: TestBucket, **fetch_options: Any) -> Iterator[tuple[LatencyProxy, FetchEngine, str]]:
    """A fault proxy before the bucket's server, an engine (4 attempts, 64 KiB parts, and
    ``fetch_options``) reading through it, and the URL of a 200 KiB object ``r/cls/a.bin``; skips for
    stores with no server."""
    with contextlib.ExitStack() as stack:
        try:
            proxy, options = stack.enter_context(buckets.through_proxy(bucket))
        except LookupError as exc:
            pytest.skip(str(exc))
        options_ = FetchOptions(**{**FAST, "attempts": 4, "part_size": "64KiB", **fetch_options})
        engine = FetchEngine(options_, _protocol(bucket), options)
        stack.callback(engine.close)
        yield proxy, engine, bucket.url("r/cls/a.bin")


def _data_gets(proxy: LatencyProxy) -> int:
    """GETs of object bytes. The GCS reader asks for an object's generation in a second GET where the
    store does not send it with the bytes (the emulator never does): those are not counted."""
    return sum(method == "GET" and "fields=generation" not in target for method, target in proxy.requests)


@pytest.mark.parametrize("mode", ["status503", "status500", "reset", "close"])
def test_transient_failures_are_retried(any_bucket: TestBucket, mode: FaultMode) -> None:
    """Two failed GETs, then the bytes; a failed part of a ranged read is retried on its own. Each
    failure costs one attempt of the engine's budget: no client library retries behind its back."""
    data = os.urandom(200 * 1024 + 5)
    any_bucket.put("r/cls/a.bin", data)
    with _proxied(any_bucket) as (proxy, engine, url):
        assert _fetch(engine, url)[0] == data  # opens a connection: a fault then hits a reused one
        engine.reset_stats()
        proxy.fail_next(2, mode, method="GET")
        assert _fetch(engine, url)[0] == data
        assert proxy.faults_triggered == 2 and engine.stats()["retries"] == 2
        engine.reset_stats()
        proxy.reset_counts()
        proxy.fail_next(1, mode, method="GET")
        assert _fetch(engine, url, size=len(data))[0] == data  # four parts, the first one failing once
        assert proxy.faults_triggered == 1 and engine.stats()["retries"] == 1
        assert engine.stats()["requests"] == 5 == _data_gets(proxy)


@pytest.mark.parametrize(("mode", "error"), [("status503", Throttled), ("status500", FetchError)])
def test_exhausted_retries_are_the_final_error(
    any_bucket: TestBucket, mode: FaultMode, error: type[FetchError]
) -> None:
    any_bucket.put("r/cls/a.bin", b"payload")
    # Throttling spends no attempts: its budget is throttle_wait seconds of being throttled.
    with _proxied(any_bucket, throttle_wait=0.5) as (proxy, engine, url):
        proxy.fail_next(100, mode, method="GET")
        out = engine.fetch_many_sync([(url, None, None)], timeout=60)
        assert type(out[0]) is error, out[0]  # throttling and server errors are told apart on every store
        if mode == "status500":
            assert url in str(out[0]) and "4 attempts" in str(out[0])
            assert _data_gets(proxy) == 4
        else:
            assert re.match(
                rf"{re.escape(url)}: (still throttled after \d+ attempts over|throttled for) 0\.", str(out[0])
            )
            assert _data_gets(proxy) >= 2

"""Listing: ImageFolder parity on every backend, odd keys, errors, and the remembered listing."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from blobdata._errors import (
    AccessDenied,
    ConfigError,
    EmptyDatasetError,
    FetchError,
    ManifestError,
    NotFound,
    Throttled,
)
from blobdata._listing import IMG_EXTENSIONS, Manifest, identity_from_info, list_folder, load_or_list
from blobdata._retry import final_error
from blobdata._stores import credential_hint

# A tree with everything ImageFolder has an opinion about: nested files, mixed-case extensions,
# non-image files, files directly under the root, unicode, spaces and '+' in names, and directory
# names whose sort order differs from the plain key order ("c d" vs "c d/x", "b" vs "b sub").
TREE: dict[str, bytes] = {
    "top.jpg": b"root file, not a sample",
    "README.txt": b"not a sample",
    "a/1.JPG": b"a1",
    "a/2.png": b"a2!",
    "a/notes.txt": b"skip",
    "a/Ünïcødé name+1.jpeg": b"unicode",
    "a/sub/deeper/3.webp": b"deep",
    "a/sub/0.TIFF": b"tiff",
    "b/z.jpg": b"zz",
    "b/x/y.PNG": b"yy",
    "b/x y/w.jpg": b"space dir",
    "b/x+y/v.bmp": b"plus dir",
    "c d/é+ f.jpeg": b"e",
    "c d/x/q.ppm": b"q",
    "c d/x/r.pgm": b"r",
    "c d/data.json": b"{}",
}
MAX_ERROR_SECONDS = 30.0


def reference_make_dataset(
    directory: str,
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
) -> tuple[list[str], dict[str, int], list[tuple[str, int]]]:
    """torchvision's find_classes + make_dataset, written from its documented behaviour."""
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    if extensions is None and is_valid_file is None:
        extensions = IMG_EXTENSIONS

    def valid(path: str) -> bool:
        if is_valid_file is not None:
            return is_valid_file(path)
        assert extensions is not None
        return path.lower().endswith(extensions)

    samples: list[tuple[str, int]] = []
    for cls in classes:
        target_dir = os.path.join(directory, cls)
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if valid(path):
                    samples.append((os.path.relpath(path, directory), class_to_idx[cls]))
    return classes, class_to_idx, samples


def write_tree(root: Path, tree: dict[str, bytes]) -> None:
    for key, data in tree.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def pairs(m: Manifest) -> list[tuple[str, int]]:
    return [(m.relkey(i), m.target(i)) for i in range(len(m))]


@pytest.fixture
def local_tree(tmp_path: Path) -> Path:
    root = tmp_path / "train"
    write_tree(root, TREE)
    return root


@pytest.fixture
def memory_root() -> Iterator[str]:
    base = f"/blobdata-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    yield base
    if fs.exists(base):
        fs.rm(base, recursive=True)


def assert_parity(m: Manifest, reference: tuple[list[str], dict[str, int], list[tuple[str, int]]]) -> None:
    classes, class_to_idx, samples = reference
    assert m.classes == classes
    assert m.class_to_idx == class_to_idx
    assert pairs(m) == samples
    assert len(samples) > 0


# -- ImageFolder parity ---------------------------------------------------------------------------


def test_parity_local(local_tree: Path) -> None:
    m = list_folder(str(local_tree))
    assert_parity(m, reference_make_dataset(str(local_tree)))
    assert m.root == "file://" + str(local_tree)
    for i in range(len(m)):
        assert (local_tree / m.relkey(i)).read_bytes() == TREE[m.relkey(i)]
        assert m.size(i) == len(TREE[m.relkey(i)])


def test_parity_local_with_extensions_and_is_valid_file(local_tree: Path) -> None:
    # As torchvision: the file name is lower-cased, the extensions are not (".TIFF" matches nothing,
    # ".png" matches y.PNG). Before, both were lower-cased and ".TIFF" matched 0.TIFF.
    exts = (".png", ".TIFF", ".ppm")
    m = list_folder(str(local_tree), extensions=exts)
    assert_parity(m, reference_make_dataset(str(local_tree), extensions=exts))
    assert "a/sub/0.TIFF" not in pairs_keys(m) and "b/x/y.PNG" in pairs_keys(m)

    def no_digits(path: str) -> bool:
        return not any(ch.isdigit() for ch in os.path.basename(path))

    seen: list[str] = []

    def opens(path: str) -> bool:  # a filter that opens the file, as corrupt-image filters do
        seen.append(path)
        with open(path, "rb") as fh:
            return fh.read(1) != b"s"  # "skip"

    # is_valid_file sees what ImageFolder gives it: for a local folder, the path (before: a file:// URL).
    m2 = list_folder(str(local_tree), is_valid_file=no_digits)
    assert_parity(m2, reference_make_dataset(str(local_tree), is_valid_file=no_digits))
    m3 = list_folder(str(local_tree), is_valid_file=opens)
    assert_parity(m3, reference_make_dataset(str(local_tree), is_valid_file=opens))
    assert seen and all(p.startswith(str(local_tree) + "/") for p in seen)


def pairs_keys(m: Manifest) -> list[str]:
    return [m.relkey(i) for i in range(len(m))]


def test_parity_memory(local_tree: Path, memory_root: str) -> None:
    fs = fsspec.filesystem("memory")
    for key, data in TREE.items():
        fs.pipe(f"{memory_root}/{key}", data)
    m = list_folder("memory://" + memory_root)
    assert_parity(m, reference_make_dataset(str(local_tree)))
    assert fs.cat(m.url(0)[len("memory://") :]) == TREE[m.relkey(0)]


@pytest.mark.network
def test_parity_s3(local_tree: Path, s3_bucket: Any) -> None:
    s3_bucket.put_many({f"imagenet/train/{k}": v for k, v in TREE.items()})
    m = list_folder(s3_bucket.url("imagenet/train"), storage_options=s3_bucket.storage_options)
    assert_parity(m, reference_make_dataset(str(local_tree)))
    assert m.root == s3_bucket.url("imagenet/train")
    assert m.url(0) == f"s3://{s3_bucket.name}/imagenet/train/{m.relkey(0)}"
    assert [m.size(i) for i in range(len(m))] == [len(TREE[m.relkey(i)]) for i in range(len(m))]
    ident = m.identity(0)
    assert ident and '"' not in ident
    # Unicode, spaces and '+' round-trip exactly into the URL.
    urls = {m.url(i) for i in range(len(m))}
    assert s3_bucket.url("imagenet/train/a/Ünïcødé name+1.jpeg") in urls
    assert s3_bucket.url("imagenet/train/c d/é+ f.jpeg") in urls


@pytest.mark.network
@pytest.mark.parametrize("bucket_fixture", ["gcs_bucket", "az_bucket"])
def test_parity_gcs_and_azure(local_tree: Path, bucket_fixture: str, request: pytest.FixtureRequest) -> None:
    bucket = request.getfixturevalue(bucket_fixture)
    for key, data in TREE.items():  # one at a time: the GCS emulator drops parallel uploads
        bucket.put(f"train/{key}", data)
    m = list_folder(bucket.url("train"), storage_options=bucket.storage_options)
    assert_parity(m, reference_make_dataset(str(local_tree)))
    assert m.url(0) == bucket.url("train/" + m.relkey(0))
    assert all(m.identity(i) and '"' not in m.identity(i) for i in range(len(m)))
    assert [m.size(i) for i in range(len(m))] == [len(TREE[m.relkey(i)]) for i in range(len(m))]


@pytest.mark.network
def test_s3_bucket_root_and_markers(s3_bucket: Any) -> None:
    s3_bucket.put_many(
        {
            "a/1.jpg": b"1",
            "a/": b"",  # directory markers are never samples
            "a/sub/": b"",
            "a/sub/2.jpg": b"2",
            "marked/": b"",  # a class that exists only as a marker: empty
            "loose.jpg": b"not a sample",
        }
    )
    url = s3_bucket.url("")
    with pytest.raises(EmptyDatasetError) as err:
        list_folder(url, storage_options=s3_bucket.storage_options)
    assert "marked" in str(err.value) and ".jpg" in str(err.value)
    m = list_folder(url, storage_options=s3_bucket.storage_options, allow_empty=True)
    assert m.classes == ["a", "marked"]
    assert pairs(m) == [("a/1.jpg", 0), ("a/sub/2.jpg", 0)]
    assert m.class_counts() == [2, 0]


# -- empty datasets and arguments ---------------------------------------------------------------


def test_empty_class_and_allow_empty(tmp_path: Path) -> None:
    write_tree(tmp_path, {"cat/1.jpg": b"x", "dog/readme.txt": b"x", "eel/x.gif": b"x"})
    with pytest.raises(EmptyDatasetError) as err:
        list_folder(str(tmp_path))
    msg = str(err.value)
    assert "dog, eel" in msg and ".webp" in msg and isinstance(err.value, FileNotFoundError)
    m = list_folder(str(tmp_path), allow_empty=True)
    assert m.classes == ["cat", "dog", "eel"] and m.class_counts() == [1, 0, 0]


def test_no_class_folder(tmp_path: Path) -> None:
    write_tree(tmp_path, {"1.jpg": b"x", "2.jpg": b"y"})
    with pytest.raises(EmptyDatasetError, match="class folder") as err:
        list_folder(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_extensions_and_is_valid_file_are_exclusive(local_tree: Path) -> None:
    with pytest.raises(ConfigError) as err:
        list_folder(str(local_tree), extensions=(".jpg",), is_valid_file=lambda p: True)
    assert isinstance(err.value, ValueError)


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="nothing found"):
        list_folder(str(tmp_path / "nope"))


# -- keys that must never be normalised -----------------------------------------------------------


@pytest.mark.network
def test_dotdot_and_double_slash_keys_kept(verbatim_s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    from blobdata.testing import s3_client

    client = s3_client(verbatim_s3)
    client.create_bucket(Bucket="odd-keys")
    keys = [
        "ds/b/ok.jpg",
        "ds/b//dbl.jpg",
        "ds/b/../up.jpg",
        "ds/b/./dot.jpg",
        "ds//orphan.jpg",
        "ds//x/o2.jpg",
    ]
    for key in keys:
        client.put_object(Bucket="odd-keys", Key=key, Body=b"x")
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        m = list_folder("s3://odd-keys/ds", storage_options=verbatim_s3.storage_options)
    assert m.classes == ["b"]
    urls = [m.url(i) for i in range(len(m))]
    assert sorted(urls) == sorted(f"s3://odd-keys/{k}" for k in keys[:4])
    # Directories in sorted(os.walk) order: "b" < "b/" < "b/." < "b/.."
    assert urls == [
        f"s3://odd-keys/{k}" for k in ("ds/b/ok.jpg", "ds/b//dbl.jpg", "ds/b/./dot.jpg", "ds/b/../up.jpg")
    ]
    assert m.skipped == ["s3://odd-keys/ds//orphan.jpg", "s3://odd-keys/ds//x/o2.jpg"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 object(s)" in w and "s3://odd-keys/ds//orphan.jpg" in w for w in warnings)


# -- errors at construction ---------------------------------------------------------------------


def _raises_in_time(cls: type[Exception], url: str, storage_options: dict[str, Any]) -> Exception:
    start = time.monotonic()
    with pytest.raises(cls) as err:
        list_folder(url, storage_options=storage_options)
    assert time.monotonic() - start < MAX_ERROR_SECONDS
    assert url in str(err.value)
    assert storage_options.get("secret", "\x00") not in str(err.value)
    return err.value


@pytest.mark.network
def test_missing_bucket(s3_bucket: Any) -> None:
    url = f"s3://{s3_bucket.name}-missing/train"
    err = _raises_in_time(NotFound, url, s3_bucket.storage_options)
    assert "bucket" in str(err) and not isinstance(err, EmptyDatasetError)


@pytest.mark.network
def test_missing_prefix(s3_bucket: Any) -> None:
    s3_bucket.put("train/a/1.jpg", b"x")
    _raises_in_time(NotFound, s3_bucket.url("trian"), s3_bucket.storage_options)


@pytest.mark.network
def test_bad_secret(s3_bucket: Any) -> None:
    s3_bucket.put("train/a/1.jpg", b"x")
    opts = {**s3_bucket.storage_options, "secret": "definitely-wrong-secret"}
    _raises_in_time(AccessDenied, s3_bucket.url("train"), opts)


@pytest.mark.network
def test_wrong_endpoint_port(s3_bucket: Any) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {**s3_bucket.storage_options, "endpoint_url": f"http://127.0.0.1:{port}"}
    err = _raises_in_time(FetchError, s3_bucket.url("train"), opts)
    assert "endpoint_url" in str(err)


def test_throttle_is_never_not_found() -> None:
    from botocore.exceptions import ClientError

    for code, status in (("SlowDown", 503), ("NoSuchKey", 503), ("Whatever", 429)):
        response: Any = {
            "Error": {"Code": code, "Message": "x"},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }
        try:
            try:
                raise ClientError(response, "ListObjectsV2")
            except ClientError as inner:
                raise FileNotFoundError("s3fs's translation") from inner
        except FileNotFoundError as outer:
            err = final_error(outer, "s3://b/p", hint=credential_hint("s3"), what="listing")
        assert isinstance(err, Throttled) and not isinstance(err, FileNotFoundError), code
        assert "s3://b/p" in str(err)


def test_identity_from_info() -> None:
    assert identity_from_info("s3", {"ETag": '"abc"', "size": 1}) == "abc"
    assert identity_from_info("s3", {"ETag": '"abc"', "VersionId": "v1"}) == "abc@v1"
    assert identity_from_info("s3", {"ETag": '"abc"', "VersionId": "null"}) == "abc"
    assert identity_from_info("gs", {"generation": "1712", "etag": "CJ"}) == "1712"
    assert identity_from_info("az", {"etag": '"0x8DC"'}) == "0x8DC"
    assert identity_from_info("file", {"mtime_ns": 17, "size": 3}) == "17-3"
    assert identity_from_info("memory", {"created": 1.5, "size": 2}) == "1.5-2"


def test_local_identity_matches_stat(local_tree: Path) -> None:
    m = list_folder(str(local_tree))
    path = local_tree / m.relkey(0)
    assert m.identity(0) == identity_from_info("file", {"name": str(path), "size": path.stat().st_size})
    os.utime(path, ns=(1, 1_000_000_001))
    assert list_folder(str(local_tree)).identity(0) == f"1000000001-{path.stat().st_size}"


# -- the remembered listing ---------------------------------------------------------------------


def _listing_requests(proxy: Any) -> list[tuple[str, str]]:
    return list(proxy.requests)


@pytest.mark.network
def test_load_or_list_remembers_and_refresh_relists(
    s3_bucket: Any, s3_proxy: Any, isolated_cache_home: Any
) -> None:
    s3_bucket.put_many({"train/a/1.jpg": b"1", "train/b/2.jpg": b"22"})
    url = s3_bucket.url("train")
    opts = s3_proxy.storage_options
    s3_proxy.reset_counts()
    first = load_or_list(url, storage_options=opts, refresh=False, manifest=None)
    assert len(first) == 2 and _listing_requests(s3_proxy), "the first call must list"

    s3_bucket.put("train/b/3.jpg", b"333")
    s3_proxy.reset_counts()
    second = load_or_list(url, storage_options=opts, refresh=False, manifest=None)
    assert _listing_requests(s3_proxy) == []
    assert pairs(second) == pairs(first)

    third = load_or_list(url, storage_options=opts, refresh=True, manifest=None)
    assert _listing_requests(s3_proxy), "refresh=True must list again"
    assert pairs(third) == [("a/1.jpg", 0), ("b/2.jpg", 1), ("b/3.jpg", 1)]
    s3_proxy.reset_counts()
    assert pairs(load_or_list(url, storage_options=opts, refresh=False, manifest=None)) == pairs(third)
    assert _listing_requests(s3_proxy) == []


def test_local_folders_are_listed_afresh_as_imagefolder_does(
    local_tree: Path, isolated_cache_home: Any
) -> None:
    first = load_or_list(str(local_tree), storage_options=None, refresh=False, manifest=None)
    (local_tree / "a" / "new.jpg").write_bytes(b"n")
    again = load_or_list(str(local_tree), storage_options=None, refresh=False, manifest=None)
    assert len(again) == len(first) + 1  # before: 6 without refresh, where ImageFolder sees 7
    assert not list(Path(isolated_cache_home).rglob("*.manifest"))  # nothing remembered
    pngs = load_or_list(str(local_tree), extensions=(".png",), allow_empty=True)
    assert {Path(pngs.relkey(i)).suffix.lower() for i in range(len(pngs))} == {".png"}


@pytest.mark.network
def test_precomputed_manifest(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, isolated_cache_home: Any
) -> None:
    s3_bucket.put_many({"train/a/1.jpg": b"1", "train/b/2.jpg": b"22"})
    url = s3_bucket.url("train")
    listed = list_folder(url, storage_options=s3_bucket.storage_options)
    path = tmp_path / "shared" / "train.manifest"
    listed.save(path)
    s3_proxy.reset_counts()
    got = load_or_list(url, storage_options=s3_proxy.storage_options, refresh=False, manifest=str(path))
    assert pairs(got) == pairs(listed) and _listing_requests(s3_proxy) == []
    # Another root: refused, naming the file.
    with pytest.raises(ManifestError) as err:
        load_or_list(s3_bucket.url("val"), storage_options=None, refresh=False, manifest=str(path))
    assert str(path) in str(err.value)
    # Shared through the bucket itself, read by URL.
    s3_bucket.put("manifests/train.manifest", path.read_bytes())
    got2 = load_or_list(
        url,
        storage_options=s3_bucket.storage_options,
        refresh=False,
        manifest=s3_bucket.url("manifests/train.manifest"),
    )
    assert pairs(got2) == pairs(listed)
    with pytest.raises(NotFound):
        load_or_list(
            url,
            storage_options=s3_bucket.storage_options,
            refresh=False,
            manifest=s3_bucket.url("manifests/nope"),
        )


def test_precomputed_manifest_corrupt(local_tree: Path, tmp_path: Path) -> None:
    path = tmp_path / "m.manifest"
    list_folder(str(local_tree)).save(path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ManifestError) as err:
        load_or_list(str(local_tree), storage_options=None, refresh=False, manifest=str(path))
    assert str(path) in str(err.value)


# -- the lean S3 path against s3fs's ------------------------------------------------------------


def _both_listers(url: str, storage_options: dict[str, Any]) -> list[Any]:
    """(sorted classes, each folder's objects sorted) from the s3fs lister and from the lean one,
    or the error each raised, stated as list_folder states it."""
    from blobdata._config import FetchOptions
    from blobdata._listing import list_with
    from blobdata._loop import run
    from blobdata._stores import resolve_storage_options
    from blobdata._stores.fsspec import get_fs
    from blobdata._stores.s3.listing import S3fsLister, S3LeanLister
    from blobdata._url import parse_url

    parsed = parse_url(url)
    opts = resolve_storage_options("s3", storage_options)
    out: list[Any] = []
    options = FetchOptions(concurrency=8)
    for lister in (S3fsLister(parsed, get_fs("s3", opts), options), S3LeanLister(parsed, opts, options)):
        try:
            classes, results = run(list_with(lister, parsed, 8))
            out.append((classes, [sorted(objs) for objs in results]))
        except Exception as exc:
            err = final_error(exc, url, hint=credential_hint("s3"), what="listing")
            out.append((type(err), str(err)))
        finally:
            run(lister.aclose())
    return out


@pytest.mark.network
@pytest.mark.slow
def test_lean_lister_matches_s3fs(s3_bucket: Any, s3_proxy: Any) -> None:
    big = {f"train/big/{i:04d} ü+ x.jpg": b"b" * (i % 5) for i in range(1005)}  # two pages
    s3_bucket.put_many({**{f"train/{k}": v for k, v in TREE.items()}, **big})
    s3_proxy.reset_counts()
    s3fs_result, lean_result = _both_listers(s3_bucket.url("train"), s3_proxy.storage_options)
    assert lean_result == s3fs_result
    classes, results = lean_result
    assert classes == ["a", "b", "big", "c d"] and len(results) == 4
    assert len(results[2]) == 1005 and ("big/0007 ü+ x.jpg", 2, results[2][7][2]) == results[2][7]
    assert all(ident and '"' not in ident for objs in results for _, _, ident in objs)
    # The lean path's canonical (sorted) query tells its requests from botocore's.
    lean_pages = [p for m, p in s3_proxy.requests if m == "GET" and "encoding-type=url&list-type=2" in p]
    assert len(lean_pages) == 6  # the root, one page for each small class, two for "big"
    assert sum("continuation-token=" in p for p in lean_pages) == 1
    m = list_folder(s3_bucket.url("train"), storage_options=s3_bucket.storage_options)
    assert m.class_counts()[2] == 1005


@pytest.mark.network
def test_lean_lister_matches_s3fs_on_verbatim_keys(verbatim_s3: Any) -> None:
    from blobdata.testing import s3_client

    client = s3_client(verbatim_s3)
    client.create_bucket(Bucket="odd-keys-lean")
    keys = ["ds/b/ok.jpg", "ds/b//dbl.jpg", "ds/b/../up.jpg", "ds/b/./dot.jpg", "ds//orphan.jpg",
            "ds/c/ctrl\x01\x1f.jpg", "ds/c/tab\t+ sp.jpg", "ds/c/%41%2B.jpg", "ds/日本/語.jpg"]  # fmt: skip
    for key in keys:
        client.put_object(Bucket="odd-keys-lean", Key=key, Body=key.encode())
    s3fs_result, lean_result = _both_listers("s3://odd-keys-lean/ds", verbatim_s3.storage_options)
    assert lean_result == s3fs_result
    listed = {f"ds/{rel}" for objs in lean_result[1] for rel, _, _ in objs}
    assert listed == set(keys)


@pytest.mark.network
def test_lean_lister_errors_match_s3fs(s3_bucket: Any) -> None:
    s3_bucket.put("train/a/1.jpg", b"x")
    missing = _both_listers(f"s3://{s3_bucket.name}-missing/train", s3_bucket.storage_options)
    assert missing[0] == missing[1] and missing[0][0] is NotFound
    opts = {**s3_bucket.storage_options, "secret": "definitely-wrong-secret"}
    denied = _both_listers(s3_bucket.url("train"), opts)
    assert denied[0] == denied[1] and denied[0][0] is AccessDenied
    assert "definitely-wrong-secret" not in denied[1][1]
    nothing = _both_listers(s3_bucket.url("trian"), s3_bucket.storage_options)
    assert nothing[0] == nothing[1] and nothing[0][0] is NotFound


def test_lean_s3_path_only_for_what_it_supports() -> None:
    from blobdata._config import FetchOptions
    from blobdata._stores import lister_for
    from blobdata._stores.s3.listing import S3fsLister, S3LeanLister
    from blobdata._stores.s3.listing import lean_s3 as _lean_s3
    from blobdata._url import parse_url

    url = parse_url("s3://bucket/train")
    base = {
        "key": "k",
        "secret": "s",
        "endpoint_url": "http://127.0.0.1:1",
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"max_pool_connections": 9},
    }
    assert isinstance(lister_for(url, base, FetchOptions(concurrency=4)), S3LeanLister)
    assert _lean_s3({**base, "version_aware": False, "requester_pays": False})
    versioned = lister_for(url, {**base, "version_aware": True}, FetchOptions(concurrency=4))
    assert isinstance(versioned, S3fsLister)
    for extra in (
        {"requester_pays": True},
        {"s3_additional_kwargs": {"RequestPayer": "requester"}},
        {"use_ssl": False},
        {"config_kwargs": {"s3": {"addressing_style": "virtual"}}},
        {"client_kwargs": {"region_name": "eu-west-1", "config": None}},
        {"username": "k"},
    ):
        assert not _lean_s3({**base, **extra}), extra


# -- issue 22: a remembered listing is never reused for another is_valid_file -------------------------


def only(ext: str) -> Callable[[str], bool]:
    def check(path: str) -> bool:  # the pattern torchvision's own tests use
        return path.endswith(ext)

    return check


SUFFIX = ".png"


def by_global(path: str) -> bool:
    return path.endswith(SUFFIX)


class Stateful:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, path: str) -> bool:
        self.calls += 1
        return True


def test_filters_are_identified_by_what_they_depend_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from blobdata._listing import filter_identity

    ids = {name: filter_identity(fn) for name, fn in {
        "png": only(".png"), "png again": only(".png"), "jpeg": only(".jpeg"),
        "lambda png": lambda p: p.endswith(".png"), "lambda jpeg": lambda p: p.endswith(".jpeg"),
        "partial png": functools.partial(str.endswith, suffix=".png"),
        "global": by_global,
    }.items()}  # fmt: skip
    assert None not in ids.values()
    assert ids["png"] == ids["png again"]  # the same code over the same values: the same filter
    assert len({ids[k] for k in ids if k != "png again"}) == len(ids) - 1  # all others differ
    monkeypatch.setattr(sys.modules[__name__], "SUFFIX", ".jpeg")
    assert filter_identity(by_global) != ids["global"]  # a global it reads changed
    assert filter_identity(Stateful()) is None
    assert filter_identity(only(re.compile(r"\.png$").pattern)) is not None


@pytest.mark.network
def test_another_filter_of_the_same_code_is_never_given_a_remembered_listing(
    s3_bucket: Any, s3_proxy: Any, isolated_cache_home: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: only('.png') then only('.jpeg') (closures of one code) got the same remembered listing,
    12 and 12 samples where ImageFolder gives 12 and 1."""
    s3_bucket.put_many({f"train/c{i % 2}/{i}.png": b"p" for i in range(12)} | {"train/c1/x.jpeg": b"j"})
    url, opts = s3_bucket.url("train"), s3_proxy.storage_options
    pngs = load_or_list(url, storage_options=opts, is_valid_file=only(".png"))
    jpegs = load_or_list(url, storage_options=opts, is_valid_file=only(".jpeg"), allow_empty=True)
    assert (len(pngs), len(jpegs)) == (12, 1)
    s3_proxy.reset_counts()
    again = load_or_list(url, storage_options=opts, is_valid_file=only(".png"))
    assert len(again) == 12 and _listing_requests(s3_proxy) == []  # the same filter: remembered
    # A filter that cannot be identified: listed afresh every time, said once on the logger.
    caplog.set_level(logging.WARNING, logger="blobdata")
    for _ in range(2):
        s3_proxy.reset_counts()
        assert len(load_or_list(url, storage_options=opts, is_valid_file=Stateful())) == 13
        assert _listing_requests(s3_proxy)
    said = [r for r in caplog.records if "afresh" in r.getMessage()]
    assert len(said) == 1 and "Stateful" in said[0].getMessage()


def test_an_empty_local_folder_is_said_as_torchvision_says_it(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^Couldn't find any class folder in /.*/empty\.$"):
        list_folder(str(tmp_path / "empty"))
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    # A flat folder: torchvision's words, then what was found and what to use (issue 30).
    flat = r"^Couldn't find any class folder in /.*/flat: found 1 image at the root"
    with pytest.raises(FileNotFoundError, match=flat):
        list_folder(str(tmp_path / "flat"))

"""What a new user trips on (issue 11): each test failed on the old behaviour."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from blobdata import BlobCache, CacheError, DecodeError, FolderDataset, NotFound


def _tree(root: Path, n: int = 6) -> Path:
    for i in range(n):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.png").write_bytes(b"x%d" % i)
    return root


def _bytes_of(f: Any) -> bytes:
    data: bytes = f.read()
    if data == b"x3":
        raise ValueError("unreadable on purpose")
    return data


@pytest.mark.parametrize(
    "method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)]  # spawn: workers import torch afresh
)
def test_skipped_samples_reach_the_main_process(tmp_path: Path, method: str) -> None:
    ds = FolderDataset(_tree(tmp_path / "d"), loader=_bytes_of, on_error="skip", lookahead=0)
    loader = ds.dataloader(batch_size=2, num_workers=2, multiprocessing_context=method, timeout=60)
    got = sum(len(b[1]) for b in loader)
    assert got == 5
    assert [url for url, _ in ds.errors] == ["file://" + str(tmp_path / "d" / "c1" / "3.png")]  # before: []
    url, exc = ds.errors[0]
    assert isinstance(exc, DecodeError) and exc.url == url and "unreadable on purpose" in str(exc)
    list(loader)  # a second epoch reports it again, once
    assert len(ds.errors) == 2


def test_unusable_cache_dir_fails_at_construction(tmp_path: Path) -> None:
    _tree(tmp_path / "d")
    (tmp_path / "file").write_text("in the way")
    for bad in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(CacheError) as info:
            FolderDataset(tmp_path / "d", cache=bad)
        assert str(bad) in str(info.value)


def test_cache_accepts_a_directory_or_a_blobcache_and_the_old_names_warn(tmp_path: Path) -> None:
    root = _tree(tmp_path / "d")
    ds = FolderDataset(root, cache=tmp_path / "c1")
    assert ds.cache_dir == str(tmp_path / "c1") and ds.cache_size == 100 * 10**9
    ds = FolderDataset(root, cache=BlobCache(tmp_path / "c2", size_limit="1MB", policy="lru"))
    assert ds.cache is not None and ds.cache.policy == "lru" and ds.cache_size == 10**6
    with pytest.warns(DeprecationWarning, match="cache="):
        old = FolderDataset(root, cache_dir=tmp_path / "c3", cache_size="2MB", cache_policy="lru")
    assert old.cache is not None and old.cache.size_limit == 2 * 10**6 and old.cache.policy == "lru"


def test_imagefolder_style_path_loader(tmp_path: Path) -> None:
    seen: list[str] = []

    def by_path(path: Any) -> bytes:  # torchvision-style: loader(path) -> open(path)
        with open(path, "rb") as fh:
            seen.append(os.fspath(path))
            return fh.read()

    ds = FolderDataset(_tree(tmp_path / "d"), loader=by_path, lookahead=0)
    assert ds[0][0] == b"x0"  # before: TypeError, open() got an ObjectFile
    # A local folder's loader gets the file itself, as ImageFolder's does (issue 22; a bucket object's
    # is a temporary copy, removed: tests/dataset/test_imagefolder.py).
    assert seen and seen[0] == ds.samples[0][0] and os.path.exists(seen[0])


def test_missing_local_folder_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(NotFound) as info:
        FolderDataset(tmp_path / "nope")
    assert "bucket" not in str(info.value) and str(tmp_path / "nope") in str(info.value)


def test_warm_and_list_from_python(tmp_path: Path) -> None:
    import blobdata

    root = _tree(tmp_path / "d", 8)
    listing = blobdata.list_folder(str(root))
    assert len(listing) == 8 and list(listing.classes) == ["c0", "c1"]
    dry = blobdata.warm(str(root), cache=tmp_path / "c", dry_run=True)
    assert dry.fits and not (tmp_path / "c").exists()
    done = blobdata.warm(str(root), cache=BlobCache(tmp_path / "c", size_limit="1MB"))
    assert done.fetched == 8 and done.failed == 0
    again = blobdata.warm(str(root), cache=tmp_path / "c")
    assert again.fetched == 0 and again.skipped == 8
    with BlobCache(tmp_path / "c") as cache:
        assert cache.stats().entries == 8

"""FolderDataset's signature reads well (issue 28): the arguments most users need first, rarely used
knobs grouped in FetchOptions and BlobCache, and everything users passed before still works."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from blobdata import BlobCache, ConfigError, FetchOptions, FolderDataset


def _folder(tmp_path: Path) -> Path:
    for c in ("a", "b"):
        (tmp_path / "d" / c).mkdir(parents=True)
        (tmp_path / "d" / c / "0.png").write_bytes(b"x")
    return tmp_path / "d"


def test_the_signature_is_imagefolders_then_a_few_keyword_settings() -> None:
    params = inspect.signature(FolderDataset.__init__).parameters
    named = [p for p in params if p not in ("self", "legacy")]
    assert named[:7] == ["root", "transform", "target_transform", "loader", "extensions", "is_valid_file",
                         "allow_empty"]  # fmt: skip
    assert named[7:] == ["storage_options", "cache", "manifest", "refresh", "listing_max_age", "on_error",
                         "fetch_options", "share_listing", "skip_hidden", "node_share", "peers"]  # fmt: skip
    assert all(params[p].kind is inspect.Parameter.KEYWORD_ONLY for p in named[7:])
    doc = FolderDataset.__doc__ or ""
    assert "Most users need four arguments" in doc and "FetchOptions" in doc and "BlobCache" in doc


def test_lookahead_lives_in_fetch_options_and_the_old_spelling_still_works(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    grouped = FolderDataset(root, fetch_options=FetchOptions(lookahead=8, lookahead_bytes="1MiB"))
    assert (grouped.lookahead, grouped.lookahead_bytes) == (8, 1024**2)
    old = FolderDataset(root, lookahead=0, lookahead_bytes="2MiB")  # as code written for 0.2 passes it
    assert (old.lookahead, old.lookahead_bytes) == (0, 2 * 1024**2)
    assert old.fetch_options.lookahead == 0
    both = FolderDataset(root, fetch_options=FetchOptions(timeout=5, lookahead=8), lookahead=2)
    assert both.lookahead == 2 and both.fetch_options.timeout == 5  # the explicit one wins, nothing lost
    with pytest.raises(ConfigError, match="lookahead"):
        FetchOptions(lookahead=-1)


def test_the_deprecated_cache_spellings_still_work_with_a_warning(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    with pytest.warns(DeprecationWarning, match="cache="):
        ds = FolderDataset(root, cache_dir=tmp_path / "cache", cache_policy="lru")
    assert isinstance(ds.cache, BlobCache) and ds.cache.policy == "lru"


def test_a_misspelt_keyword_is_a_type_error_as_pythons_own(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'lookahed'"):
        FolderDataset(_folder(tmp_path), lookahed=0)

"""The bound belongs to the cache (issue 30, item 1): an opener naming no size uses the stored one; a
smaller size evicts nothing and says how to shrink on purpose; a larger one raises it, said at INFO;
``shrink=True`` and ``blobdata cache trim --cache-size`` shrink, and say so."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest

from blobdata._cache import SLACK_BYTES, BlobCache
from blobdata._cli import main

VALUE = 40_000
N = 100  # 4 MB warmed


def _warm(directory: Path, size: str = "10MB") -> list[str]:
    urls = [f"s3://b/train/{i}.jpg" for i in range(N)]
    with BlobCache(directory, size_limit=size) as cache:
        assert all(cache.put_many([(u, "e", bytes([i % 251]) * VALUE) for i, u in enumerate(urls)]))
    return urls


def _held(directory: Path, urls: list[str]) -> int:
    with BlobCache(directory) as cache:
        return sum((u, "e") in cache for u in urls)


def test_a_warmed_cache_survives_an_opener_that_names_no_size(tmp_path: Path) -> None:
    urls = _warm(tmp_path, "10MB")
    with BlobCache(tmp_path) as cache:
        assert cache.size_limit == 10_000_000  # the stored bound, not a default
        assert cache.stats().entries == N
    assert _held(tmp_path, urls) == N


def test_a_smaller_size_evicts_nothing_keeps_the_bound_and_says_how_to_shrink(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    urls = _warm(tmp_path, "10MB")
    with caplog.at_level(logging.INFO, logger="blobdata"), BlobCache(tmp_path, size_limit="1MB") as cache:
        assert cache.size_limit == 10_000_000
        assert cache.stats().entries == N
        assert cache.get(urls[7], "e") == bytes([7]) * VALUE
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert str(tmp_path) in text and "shrink=True" in text and "blobdata cache trim" in text
    assert "--cache-size 1MB" in text or "--cache-size 1000000" in text
    assert _held(tmp_path, urls) == N
    with BlobCache(tmp_path) as cache:  # and the next opener still sees the warmed bound
        assert cache.size_limit == 10_000_000


def test_a_worker_copy_follows_the_stored_bound_without_warning_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _warm(tmp_path, "10MB")
    cache = BlobCache(tmp_path, size_limit="1MB")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="blobdata"):
        copy = pickle.loads(pickle.dumps(cache))
        assert copy.stats().entries == N and copy.size_limit == 10_000_000
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    copy.close()
    cache.close()


def test_a_larger_size_raises_the_bound_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _warm(tmp_path, "10MB")
    with caplog.at_level(logging.INFO, logger="blobdata"), BlobCache(tmp_path, size_limit="20MB") as cache:
        assert cache.size_limit == 20_000_000
    raised = [r for r in caplog.records if "raised" in r.getMessage()]
    assert raised and raised[0].levelno == logging.INFO
    with BlobCache(tmp_path) as cache:
        assert cache.size_limit == 20_000_000


def test_an_explicit_shrink_evicts_and_is_announced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    urls = _warm(tmp_path, "10MB")
    limit = 1_000_000
    with (
        caplog.at_level(logging.INFO, logger="blobdata"),
        BlobCache(tmp_path, size_limit=limit, shrink=True) as cache,
    ):
        assert cache.size_limit == limit
        assert cache.stats().volume_bytes <= limit + SLACK_BYTES
    held = _held(tmp_path, urls)
    assert 0 < held < N
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shrink" in w and "evicted" in w and str(N - held) in w for w in warnings)
    with BlobCache(tmp_path) as cache:
        assert cache.size_limit == limit


def test_cache_trim_with_a_size_shrinks_the_bound_for_later_openers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    urls = _warm(tmp_path, "10MB")
    assert main(["cache", "trim", "--cache-dir", str(tmp_path), "--cache-size", "1MB"]) == 0
    assert "evicted" in capsys.readouterr().out
    held = _held(tmp_path, urls)
    assert 0 < held < N
    with BlobCache(tmp_path) as cache:
        assert cache.size_limit == 1_000_000


def test_warm_without_a_size_keeps_the_warmed_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data" / "cat"
    data.mkdir(parents=True)
    for i in range(3):
        (data / f"{i}.jpg").write_bytes(bytes([i]) * 1000)
    cache_dir = tmp_path / "c"
    urls = _warm(cache_dir, "10MB")
    assert main(["warm", str(tmp_path / "data"), "--cache-dir", str(cache_dir), "-q"]) == 0
    assert (
        main(["warm", str(tmp_path / "data"), "--cache-dir", str(cache_dir), "-q", "--cache-size", "1MB"])
        == 0
    )
    assert _held(cache_dir, urls) == N
    with BlobCache(cache_dir) as cache:
        assert cache.size_limit == 10_000_000 and cache.stats().entries == N + 3

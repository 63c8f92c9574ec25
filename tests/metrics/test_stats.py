"""loader.stats(): the numbers add up across the training process and fork/spawn workers, retries are
counted by cause, and the loop's wait tells a slow source from a fast one (compared side by side)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata import BlobCache, FetchOptions, FolderDataset, LoaderStats

pytestmark = pytest.mark.timeout(120)


def _obj(i: int) -> bytes:
    return bytes([i % 251]) * (100 + 37 * i)  # distinct sizes, so a byte count is a real check


def _sum_loader(f: Any) -> int:
    """A picklable loader (spawn workers import it): the byte sum stands for the decoded sample."""
    return int(np.frombuffer(f.read(), dtype=np.uint8).sum())


def _objects(n: int, prefix: str = "d") -> dict[str, bytes]:
    return {f"{prefix}/c{i % 3}/{i:03d}.png": _obj(i) for i in range(n)}


def _run(loader: Any, epochs: int = 1) -> int:
    return sum(len(batch) for _ in range(epochs) for batch, _ in loader)


@pytest.mark.network
@pytest.mark.parametrize(("workers", "method"), [(0, None), (2, "fork"), (2, "spawn")])
def test_stats_add_up(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, workers: int, method: str | None
) -> None:
    objects = _objects(30)
    s3_bucket.put_many(objects)
    ds = FolderDataset(
        s3_bucket.url("d"),
        loader=_sum_loader,
        storage_options=s3_proxy.storage_options,
        cache=BlobCache(str(tmp_path / "cache"), size_limit="10MB"),
    )
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=workers, multiprocessing_context=method)
    s3_proxy.reset_counts()
    assert _run(loader) == 30
    first = loader.stats()
    gets = [m for m, _ in s3_proxy.requests if m == "GET"]
    assert first.samples == 30 == first.samples_from_cache + first.samples_from_bucket
    assert first.samples_from_bucket == 30 and first.hit_rate == 0.0
    assert first.bytes_from_bucket == sum(len(v) for v in objects.values())  # what the server sent
    assert first.gets == len(gets) == 30
    assert first.batches == 8 and first.loop_batches == 8
    assert 0 < first.get_p50_s <= first.get_p99_s
    assert 0 < first.samples_staged <= 30  # the look-ahead had fetched some of them ahead
    assert first.decode_s_per_sample > 0 and first.fetch_wait_s_per_sample > 0
    assert first.collate_s_per_sample > 0

    # Written to the cache off the hot path: wait until the cache holds all (bounded), then a second epoch.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _cached(tmp_path / "cache") < 30:
        time.sleep(0.05)
    assert _run(loader) == 30
    both = loader.stats()
    assert both.samples == 60 == both.samples_from_cache + both.samples_from_bucket
    assert both.samples_from_cache == 30 and both.hit_rate == pytest.approx(0.5)
    assert both.bytes_from_cache == first.bytes_from_bucket
    assert both.gets == first.gets  # nothing more from the bucket
    assert both.cache_writes == 30 and both.cache_writes_dropped == 0  # written once, by the first epoch
    d = both.as_dict()
    assert d["samples"] == 60 and all(isinstance(v, int | float) for v in d.values())


def test_objects_the_cache_writer_could_not_take_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import functools

    from blobdata._cache import CacheWriter

    # A writer with room for one queued object and a long linger: a batch of 8 offers leaves 7 dropped.
    writer = functools.partial(CacheWriter, max_bytes=1, linger=30.0)
    monkeypatch.setattr("blobdata._dataset.reads.CacheWriter", writer)
    for i in range(16):
        (tmp_path / "d" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / f"c{i % 2}" / f"{i:03d}.png").write_bytes(_obj(i))
    ds = FolderDataset(tmp_path / "d", loader=_sum_loader, cache=tmp_path / "cache", lookahead=0)
    loader = ds.dataloader(batch_size=8, num_workers=0)
    with caplog.at_level(logging.INFO, logger="blobdata"):
        assert _run(loader) == 16
    ds.close()  # flushes the writer
    s = loader.stats()
    assert s.cache_writes_dropped > 0 and s.cache_writes >= 1
    assert s.cache_writes + s.cache_writes_dropped == 16 == s.samples_from_bucket
    assert _cached(tmp_path / "cache") == s.cache_writes
    assert any("not cached (the cache writer fell behind" in r.getMessage() for r in caplog.records)


def _cached(directory: Path) -> int:
    from blobdata import BlobCache

    if not directory.exists():
        return 0
    cache = BlobCache(str(directory), size_limit=10_000_000)
    try:
        return int(cache.info().get("entries", 0))
    finally:
        cache.close()


@pytest.mark.network
def test_retries_counted_by_cause(s3_bucket: Any, s3_proxy: Any) -> None:
    s3_bucket.put_many(_objects(8))
    ds = FolderDataset(
        s3_bucket.url("d"),
        loader=_sum_loader,
        storage_options=s3_proxy.storage_options,
        fetch_options=FetchOptions(backoff=0.01, max_backoff=0.05, concurrency=1),
        lookahead=0,
    )
    loader = ds.dataloader(batch_size=4, num_workers=1, multiprocessing_context="fork")
    s3_proxy.fail_next(2, "status503", method="GET")
    s3_proxy.fail_next(1, "status500", method="GET")
    s3_proxy.fail_next(1, "reset", method="GET")
    assert _run(loader) == 8
    s = loader.stats()
    assert (s.retries_throttle, s.retries_server, s.retries_connection) == (2, 1, 1)
    assert s.retries == 4 and s.samples == 8
    assert s.gets == 8  # GETs answered; the faulted attempts have no latency to report


def test_errors_skipped_are_counted(tmp_path: Path) -> None:
    for key, data in _objects(6).items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    (tmp_path / "d" / "c0" / "bad.png").write_bytes(b"x")

    def picky(f: Any) -> int:
        data = f.read()
        if len(data) < 10:
            raise ValueError("not an image")
        return len(data)

    ds = FolderDataset(tmp_path / "d", loader=picky, on_error="skip")
    loader = ds.dataloader(batch_size=7)
    assert _run(loader) == 6
    s = loader.stats()
    assert s.errors_skipped == 1 and s.samples == 6
    assert s.samples_from_bucket == 7  # read, then refused by the decoder


def _epoch(loader: Any, step_s: float) -> LoaderStats:
    for _ in loader:
        time.sleep(step_s)  # the "model"
    return loader.stats()


@pytest.mark.network
def test_wait_tells_a_slow_source_from_a_fast_one(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    objects = _objects(24)
    s3_bucket.put_many(objects)
    for key, data in objects.items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    s3_proxy.delay = 0.05  # one way: 100 ms per GET, and nothing fetched ahead
    slow = FolderDataset(
        s3_bucket.url("d"),
        loader=_sum_loader,
        storage_options=s3_proxy.storage_options,
        lookahead=0,
        fetch_options=FetchOptions(concurrency=1),
    )
    fast = FolderDataset(tmp_path / "d", loader=_sum_loader)
    step = 0.2  # a compute step long enough that reading 4 local files stays far below 10% of it, even on a
    # loaded machine (0.05 s left too little room there)
    with caplog.at_level(logging.INFO, logger="blobdata"):
        s_fast = _epoch(fast.dataloader(batch_size=4), step)
        fast_line = caplog.messages[-1]
        s_slow = _epoch(slow.dataloader(batch_size=4), step)
        slow_line = caplog.messages[-1]
    assert s_fast.samples == s_slow.samples == 24
    # Side by side: the slow source makes the loop wait far longer per batch than the fast one.
    assert s_slow.loop_wait_s > 10 * s_fast.loop_wait_s
    assert s_slow.wait_fraction > 0.5 > s_fast.wait_fraction
    assert s_slow.fetch_wait_s_per_sample > 10 * s_fast.fetch_wait_s_per_sample
    assert "input-bound" in slow_line and "waiting for the bucket" in slow_line
    assert "compute-bound" in fast_line
    # A local folder makes no GET: its line says so rather than a latency of 0 ms (issue 40, item 5).
    assert "img/s" in fast_line and "hit rate" in fast_line and "no GET (local files)" in fast_line
    assert "p99" in slow_line


def test_persistent_workers_accumulate(tmp_path: Path) -> None:
    for key, data in _objects(12).items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    ds = FolderDataset(tmp_path / "d", loader=_sum_loader)
    loader = ds.dataloader(batch_size=3, shuffle=True, num_workers=2, persistent_workers=True)
    loader._planner.across_epochs = False  # no fetches for a 4th epoch, which none of these counts serves
    assert _run(loader, epochs=3) == 36
    s = loader.stats()
    assert s.samples == 36 == s.samples_from_bucket and s.batches == 12 == s.loop_batches
    # A second loader over the same dataset counts only its own work.
    other = ds.dataloader(batch_size=3, num_workers=0)
    assert _run(other) == 12
    assert other.stats().samples == 12 and loader.stats().samples == 36


@pytest.mark.network
def test_progress_for_listing_and_manifest_download(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from blobdata._listing import Manifest, list_folder

    s3_bucket.put_many(_objects(9))
    s3_proxy.delay = 0.3  # one way: each request takes 0.6 s, past the bars' 0.5 s delay
    opts = s3_proxy.storage_options
    m = list_folder(s3_bucket.url("d"), storage_options=opts, progress=True)
    err = capsys.readouterr().err
    assert (
        f"listing {s3_bucket.url('d')}" in err and "/3 [" in err and "prefix/s" in err and " objects]" in err
    )
    s3_proxy.delay = 0.0
    list_folder(s3_bucket.url("d"), storage_options=opts)  # not a terminal: quiet
    assert capsys.readouterr().err == ""
    s3_bucket.put("m/train.manifest", m.to_bytes())
    s3_proxy.delay = 0.3
    got = Manifest.load(s3_bucket.url("m/train.manifest"), storage_options=opts, progress=True)
    assert len(got) == 9
    err = capsys.readouterr().err
    assert f"manifest {s3_bucket.url('m/train.manifest')}" in err and "B" in err
    s3_proxy.delay = 0.0
    Manifest.load(s3_bucket.url("m/train.manifest"), storage_options=opts)
    assert capsys.readouterr().err == ""


def test_records_of_exited_workers_are_folded(tmp_path: Path) -> None:
    import os

    from blobdata._metrics import TimedCollate

    for key, data in _objects(12).items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    ds = FolderDataset(tmp_path / "d", loader=_sum_loader)
    loader = ds.dataloader(batch_size=3, num_workers=2)  # new worker processes every epoch
    for epoch in range(1, 5):
        if epoch == 4:  # the last: no fetches handed over for a 5th epoch, which none of these counts serves
            loader._planner.hand_over = None
        assert _run(loader) == 12
        deadline = time.monotonic() + 10  # the epoch's workers exit shortly after its end
        while time.monotonic() < deadline and loader.stats().samples and _records(loader) > 1:
            time.sleep(0.05)
        assert loader.stats().samples == 12 * epoch
        assert _records(loader) <= 3  # the training process's own, at most two workers not yet gone
    assert loader.stats().samples_from_bucket == 48 and loader.stats().batches == 16
    # Rebuilt from its own attributes (as Lightning does), the loader does not time collate twice.
    again = type(loader)(ds, batch_size=3, collate_fn=loader.collate_fn)
    assert isinstance(again.collate_fn, TimedCollate) and not isinstance(again.collate_fn.fn, TimedCollate)
    assert os.path.isdir(loader.channel.path)


def _records(loader: Any) -> int:
    import os

    return sum(n.startswith("stats-") for n in os.listdir(loader.channel.path))

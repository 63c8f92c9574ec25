"""Stats that add up on first read (issue 40, item 5): samples counted as the loop receives them, the
next epoch's early reads counted apart from this epoch's, the LIST requests a dataset's listing took,
and no "0 ms" or "0.0 MB/s" where nothing was measured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata import BlobCache, BlobDataset, FolderDataset, LoaderStats
from tests.support.announce import wait_announced

pytestmark = pytest.mark.timeout(180)


def _sum_loader(f: Any) -> int:
    return int(np.frombuffer(f.read(), dtype=np.uint8).sum())


def _objects(n: int, prefix: str = "d") -> dict[str, bytes]:
    return {f"{prefix}/c{i % 3}/{i:03d}.png": bytes([i % 251]) * (100 + 37 * i) for i in range(n)}


def test_samples_are_those_the_loop_received_not_those_made_ahead(tmp_path: Path) -> None:
    for key, data in _objects(48).items():
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(data)
    ds = FolderDataset(tmp_path / "d", loader=_sum_loader)
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    for _ in range(5):  # the example's loop: a few steps, while the workers run ahead
        next(it)
    s = loader.stats()
    assert s.loop_batches == 5 and s.samples == 20, s
    assert s.samples_made >= s.samples  # the workers' count, batches waiting for the loop included
    assert s.samples_per_s == pytest.approx(20 / s.elapsed_s)
    del it
    loader = ds.dataloader(batch_size=5, shuffle=True)  # 48 = 9 x 5 + 3: the last batch is short
    assert sum(len(t) for _, t in loader) == 48 and loader.stats().samples == 48


@pytest.mark.network
def test_the_next_epochs_early_reads_are_counted_apart(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    """Persistent workers fetch the next epoch's first batches before this epoch ends: a cold first
    epoch says hit rate 0% and as many reads as objects, and says what it read for the next."""
    objects = _objects(60)
    s3_bucket.put_many(objects)
    ds = FolderDataset(
        s3_bucket.url("d"), loader=_sum_loader, storage_options=s3_proxy.storage_options,
        cache=BlobCache(str(tmp_path / "cache"), size_limit="10MB"),
    )  # fmt: skip
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
    s3_proxy.reset_counts()
    served = 0
    for k, (b, _) in enumerate(loader):
        if k == 0:  # the next epoch known before the workers' look-ahead reaches this one's end
            wait_announced(loader)
        served += len(b)
    assert served == 60
    # The workers go on reading the next epoch's first batches after this one ends: the wire and the
    # stats are compared once those reads are done (nothing in flight, every count still for 0.5 s).
    deadline, still, last = time.monotonic() + 60, 0, None
    while still < 10 and time.monotonic() < deadline:
        first = loader.stats()
        gets = len([m for m, _ in s3_proxy.requests if m == "GET"])
        now = (gets, first.gets, first.read_for_next_epoch, first.samples_from_bucket, first.concurrency)
        still = still + 1 if now == last and first.concurrency == 0 else 0
        last = now
        time.sleep(0.05)
    assert still == 10, f"the next epoch's reads never settled: {last}"
    assert first.samples == 60 and first.samples_from_cache == 0 and first.hit_rate == 0.0
    assert first.samples_from_bucket == 60, first  # this epoch's objects, each read once
    # The next epoch's early reads are GETs, or cache hits where this epoch's copy was written first.
    assert first.read_for_next_epoch > 0 and gets == first.gets
    assert 60 <= gets <= 60 + first.read_for_next_epoch
    assert f"{first.read_for_next_epoch} read for the next epoch's first batches" in first.summary()


@pytest.mark.network
def test_list_requests_say_what_the_listing_cost(s3_bucket: Any, tmp_path: Path) -> None:
    s3_bucket.put_many(_objects(9))
    opts = s3_bucket.storage_options
    listed = FolderDataset(s3_bucket.url("d"), loader=_sum_loader, storage_options=opts)
    assert listed.list_requests >= 4  # the class folders, then each of the three
    loader = listed.dataloader(batch_size=3)
    assert sum(len(b) for b, _ in loader) == 9
    s = loader.stats()
    assert s.list_requests == listed.list_requests
    assert f"{s.list_requests} LIST requests to list the dataset" in s.summary()
    remembered = FolderDataset(s3_bucket.url("d"), loader=_sum_loader, storage_options=opts)
    assert remembered.list_requests == 0  # the listing remembered from the first
    index = tmp_path / "index.jsonl"
    index.write_text("".join(json.dumps({"key": k[2:]}) + "\n" for k in sorted(_objects(9))))
    indexed = BlobDataset(s3_bucket.url("d"), index=index, storage_options=opts, decoders=False)
    assert indexed.list_requests == 0
    loader = indexed.dataloader(batch_size=3, collate_fn=lambda s: s)
    assert sum(len(b) for b in loader) == 9
    assert "0 LIST requests to list the dataset" in loader.stats().summary()


def test_nothing_measured_is_not_printed_as_zero() -> None:
    base = {"samples": 96, "batches": 3, "loop_batches": 3, "elapsed_s": 2.0, "loop_wait_s": 0.1,
            "wait_fraction": 0.05, "samples_per_s": 48.0}  # fmt: skip
    local = LoaderStats(**base, samples_from_bucket=96).summary()  # type: ignore[arg-type]
    assert "no GET (local files)" in local and "0 ms" not in local and "MB/s" not in local
    small = LoaderStats(
        **base, samples_from_bucket=96, bytes_from_bucket=9600, bucket_bytes_per_s=4800.0, gets=96,  # type: ignore[arg-type]
        get_p50_s=0.0004, get_p99_s=0.012,
    ).summary()
    assert "bucket 4.8 kB/s" in small and "GET p50 0.4 ms p99 12 ms" in small and "0.0 MB/s" not in small
    cached = LoaderStats(**base, samples_from_cache=96, hit_rate=1.0).summary()  # type: ignore[arg-type]
    assert "hit rate 100%, nothing from the bucket, no GET" in cached

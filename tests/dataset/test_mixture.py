"""One mixture over S3, the GCS emulator and a local folder, on real servers (issue 41): each epoch's
exact proportions and coverage, the same batches for 0 and 2 workers, a pixel-exact resume mid-epoch
with 2 workers, other weights at resume, 2 ranks that split the epoch, per-source stats, and a second
epoch (or a warmed first) that sends no GET. Every sample is in a class folder of its own, so its
target is its number in its source."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import blobdata
from blobdata import BlobCache, FolderDataset, Mixture, MixtureSampler
from blobdata.testing import LocalGCSEmulator, S3Endpoint, synthetic_jpeg
from blobdata.transforms import RandomResizedCrop
from tests.support import buckets

SIZES = {"s3": 24, "gcs": 12, "local": 12}
WEIGHTS = {"s3": 1, "gcs": 2, "local": 1}  # 48 a epoch: s3 12 of its 24, gcs each twice, local once
pytestmark = pytest.mark.timeout(600)


def _images(n: int, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"k{i:03d}/{i:03d}.jpg": synthetic_jpeg(rng, min_side=40, max_side=90) for i in range(n)}


class Stores:
    """Where the three sources live, and proxies that count the requests to the two servers."""

    def __init__(self, s3: buckets.TestBucket, gcs: buckets.TestBucket, local: Path) -> None:
        self.s3, self.gcs, self.local = s3, gcs, local
        self.proxies: dict[str, Any] = {}
        self.options: dict[str, dict[str, Any]] = {}

    def sources(self, cache: Path | None = None, **kw: Any) -> dict[str, FolderDataset]:
        c = BlobCache(str(cache)) if cache is not None else None
        t = RandomResizedCrop(16)
        return {
            "s3": FolderDataset(
                self.s3.url("d"), transform=t, storage_options=self.options["s3"], cache=c, **kw
            ),
            "gcs": FolderDataset(
                self.gcs.url("d"), transform=t, storage_options=self.options["gcs"], cache=c, **kw
            ),
            "local": FolderDataset(self.local, transform=t, **kw),
        }

    def gets(self) -> dict[str, int]:
        """Objects read from each server (the GCS emulator does not echo an object's generation, so
        each read also asks its metadata: not counted)."""
        return {
            k: sum(m == "GET" and "fields=generation" not in path for m, path in p.requests)
            for k, p in self.proxies.items()
        }

    def reset(self) -> None:
        for p in self.proxies.values():
            p.reset_counts()


@pytest.fixture(scope="module")
def stores(
    s3_server: S3Endpoint, gcs_emulator: LocalGCSEmulator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stores]:
    s3, gcs = buckets.s3_bucket(s3_server), buckets.gcs_bucket(gcs_emulator)
    local = tmp_path_factory.mktemp("mixture-local")
    s3.put_many({f"d/{k}": v for k, v in _images(SIZES["s3"], 1).items()})
    gcs.put_many({f"d/{k}": v for k, v in _images(SIZES["gcs"], 2).items()})
    for k, v in _images(SIZES["local"], 3).items():
        (local / k).parent.mkdir(parents=True, exist_ok=True)
        (local / k).write_bytes(v)
    out = Stores(s3, gcs, local)
    try:
        with buckets.through_proxy(s3) as (p3, o3), buckets.through_proxy(gcs) as (pg, og):
            out.proxies, out.options = {"s3": p3, "gcs": pg}, {"s3": o3, "gcs": og}
            yield out
    finally:
        s3.drop()
        gcs.drop()


def _run(loader: Any, epochs: int = 1, stop_after: int | None = None) -> tuple[list[Any], Any]:
    out: list[Any] = []
    for epoch in range(epochs):
        for k, (images, targets, sources) in enumerate(loader):
            out.append((images.clone(), targets.clone(), sources.clone()))
            if stop_after is not None and epoch == epochs - 1 and k + 1 == stop_after:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, None


def _pairs(batches: list[Any]) -> list[tuple[int, int]]:
    """(source number, sample number in its source) of every sample, in order."""
    return [
        (int(s), int(t)) for _, targets, sources in batches for t, s in zip(targets, sources, strict=True)
    ]


def _planned(mix: Mixture, epoch: int, world: int = 1, rank: int = 0) -> list[tuple[int, int]]:
    sampler = MixtureSampler(mix, num_replicas=world, rank=rank)
    sampler.set_epoch(epoch)
    return [(mix.names.index(n), j) for n, j in map(mix.source_of, sampler)]


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True)
    )


def test_each_epoch_reads_the_planned_counts_and_covers_each_source(stores: Stores) -> None:
    """Two epochs at 0 workers: exactly the plan (12 of s3's 24, each gcs sample twice, each local
    sample once); s3's half is another each epoch; every batch holds 1 s3, 2 gcs, 1 local (to within
    one)."""
    mix = Mixture(stores.sources(), WEIGHTS, with_source=True)
    loader = mix.dataloader(batch_size=4)
    for epoch in range(2):
        batches, _ = _run(loader)
        got = _pairs(batches)
        assert got == _planned(mix, epoch)
        per = collections.Counter(got)
        assert collections.Counter(s for s, _ in got) == {0: 12, 1: 24, 2: 12}
        assert set(per.values()) == {1, 2} and all(per[(1, j)] == 2 for j in range(12))
        assert all(per[(2, j)] == 1 for j in range(12)) and len({j for s, j in got if s == 0}) == 12
        for _, _, sources in batches:
            counts = collections.Counter(sources.tolist())
            assert abs(counts[1] - 2) <= 1 and counts[0] <= 2 and counts[2] <= 2
        if epoch == 0:
            first_s3 = {j for s, j in got if s == 0}
    assert {j for s, j in got if s == 0} != first_s3


def test_the_same_batches_for_0_and_2_workers(stores: Stores) -> None:
    runs = [
        _run(Mixture(stores.sources(), WEIGHTS, with_source=True).dataloader(batch_size=4, num_workers=w), 2)[
            0
        ]
        for w in (0, 2)
    ]
    assert len(runs[0]) == 24 and _same(runs[0], runs[1])


def test_resume_mid_epoch_with_2_workers_gives_the_uninterrupted_pixels(stores: Stores) -> None:
    def loader() -> Any:
        mix = Mixture(stores.sources(), WEIGHTS, with_source=True, seed=7)
        return mix.dataloader(batch_size=4, num_workers=2)

    full, _ = _run(loader(), epochs=2)
    first, state = _run(loader(), epochs=1, stop_after=5)
    resumed = loader()  # a new mixture and loader, as a new process makes them
    resumed.load_state_dict(state)
    rest, _ = _run(resumed, epochs=2)  # the 7 batches left of epoch 0, then epoch 1
    assert len(first) == 5 and len(rest) == 19
    assert _same(first + rest, full)
    assert not _same(full[:12], full[12:])  # epoch 1 is another order, other crops


def test_other_weights_at_resume_with_2_workers(stores: Stores) -> None:
    """strict=False: the 20 samples read stay read; the 28 left follow the new weights (s3 left out), the
    local folder first reading what it had not."""
    first, state = _run(Mixture(stores.sources(), WEIGHTS, with_source=True).dataloader(batch_size=4), 1, 5)
    new = Mixture(stores.sources(), {"s3": 0, "gcs": 1, "local": 3}, with_source=True, samples_per_epoch=48)
    resumed = new.dataloader(batch_size=4, num_workers=2)
    with pytest.raises(blobdata.ConfigError, match="other weights"):
        resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="the rest follows this mixture's"):
        resumed.load_state_dict(state, strict=False)
    rest, _ = _run(resumed)
    assert len(rest) == 7 and len(_pairs(first) + _pairs(rest)) == 48
    assert collections.Counter(s for s, _ in _pairs(rest)) == {1: 7, 2: 21}
    local_before = {j for s, j in _pairs(first) if s == 2}
    local_rest = [j for s, j in _pairs(rest) if s == 2]
    unread = set(range(12)) - local_before  # read first, then the source's draws go on
    assert len(unread) < 12 and set(local_rest[: len(unread)]) == unread


def test_two_ranks_split_the_epoch(stores: Stores) -> None:
    """Rank 0 and rank 1 of 2 (0 workers each) together read the 1-rank epoch; what s3 and the local
    folder give (read once an epoch) goes to one rank only."""
    mix = Mixture(stores.sources(), WEIGHTS, with_source=True)
    samplers = [MixtureSampler(mix, num_replicas=2, rank=r) for r in range(2)]
    ranks = [_pairs(_run(mix.dataloader(batch_size=4, sampler=s))[0]) for s in samplers]
    assert len(ranks[0]) == len(ranks[1]) == 24
    assert collections.Counter(ranks[0] + ranks[1]) == collections.Counter(_planned(mix, 0))
    once = [{p for p in r if p[0] != 1} for r in ranks]
    assert not once[0] & once[1]


def _settled(cache: Path, entries: int) -> None:
    """The cache writers' entries (written off the hot path) are all in."""
    c = BlobCache(str(cache))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and c.info()["entries"] < entries:
        time.sleep(0.05)
    c.close()


def test_the_second_epoch_with_a_cache_sends_no_get_and_stats_per_source(
    stores: Stores, tmp_path: Path
) -> None:
    """Weights that read every object once an epoch: epoch 1 GETs each remote object once, epoch 2
    none (both stores' caches in one node cache); the loader's stats say it per source."""
    mix = Mixture(stores.sources(tmp_path / "cache"), {"s3": 2, "gcs": 1, "local": 1}, with_source=True)
    loader = mix.dataloader(batch_size=4, num_workers=2)
    stores.reset()
    _run(loader)
    assert stores.gets() == {"s3": 24, "gcs": 12}
    first = loader.stats()
    assert {n: p.gets for n, p in first.sources.items()} == {"s3": 24, "gcs": 12, "local": 0}
    assert {n: p.samples for n, p in first.sources.items()} == {"s3": 24, "gcs": 12, "local": 12}
    assert first.sources["local"].samples_from_bucket == 12 and first.gets == 36
    assert first.sources["s3"].bytes_from_bucket == sum(len(v) for v in _images(24, 1).values())
    _settled(tmp_path / "cache", 36)
    stores.reset()
    _run(loader)
    assert stores.gets() == {"s3": 0, "gcs": 0}
    mix._settle_hand_over(wait_s=60.0)  # what the training process reads for the next epoch's workers
    second = loader.stats()
    assert second.sources["s3"].samples_from_cache == 24 and second.sources["gcs"].samples_from_cache == 12
    assert "sources: s3: 48 samples (50%)" in second.summary()
    # The cached sources' next first batches are read from their caches by the new workers; the local
    # folder's (no cache) by the training process for them, as for a dataset without a cache alone.
    local = second.sources["local"].read_for_next_epoch
    assert local > 0 and second.read_for_next_epoch == local and second.gets == 36 + local


def test_warm_fills_every_sources_cache(stores: Stores, tmp_path: Path) -> None:
    """blobdata.warm(mix): each remote source's objects into its cache (the local folder has none);
    then the first epoch sends no GET."""
    mix = Mixture(stores.sources(tmp_path / "cache"), WEIGHTS, with_source=True)
    summary = blobdata.warm(mix)
    assert set(summary.sources) == {"s3", "gcs"} and summary.fetched == 36 and summary.failed == 0
    assert summary.sources["s3"].fetched == 24 and blobdata.warm(mix).skipped == 36
    stores.reset()
    batches, _ = _run(mix.dataloader(batch_size=4))
    assert len(batches) == 12 and stores.gets() == {"s3": 0, "gcs": 0}


def test_the_summary_names_the_source_the_loop_waits_for(stores: Stores) -> None:
    """A loop that only takes batches, from S3 behind RTT 200 ms without a look-ahead and a local
    folder: input-bound, and ``summary()`` names S3 as the source that limits it."""
    with buckets.through_proxy(stores.s3, delay_s=0.1) as (_, slow):
        t, options = RandomResizedCrop(16), blobdata.FetchOptions(lookahead=0)
        sources = {
            "s3": FolderDataset(stores.s3.url("d"), transform=t, storage_options=slow, fetch_options=options),
            "local": FolderDataset(stores.local, transform=t),
        }
        loader = Mixture(sources, {"s3": 1, "local": 1}).dataloader(batch_size=4)
        assert sum(len(batch[0]) for batch in loader) == 36
        stats = loader.stats()
    assert stats.sources["s3"].gets == 18 and stats.sources["local"].gets == 0
    assert "input-bound" in stats.summary()
    assert "the loop is limited by source 's3' (batches waited" in stats.summary(), stats.summary()

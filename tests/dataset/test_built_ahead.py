"""A persistent worker builds its first batch of the next epoch while idle at an epoch's end (issue
33: no stall between epochs). The batches are exactly those made on demand: with blobdata's keyed
transforms, with transforms that draw from torch's, numpy's and ``random``'s global generators, when
the next epoch's order was guessed wrong, and when a sample of the built batch fails."""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

from blobdata import FolderDataset
from blobdata._fetch import PlanChannel
from blobdata.transforms import RandomResizedCrop

N = 40


def _sum_loader(f: Any) -> int:
    return int(np.frombuffer(f.read(), np.uint8).sum())


def _global_draws(x: int) -> tuple[int, int, float, int]:
    """A transform as users write them: draws from every global generator a worker seeds."""
    return x, int(torch.randint(0, 1 << 30, (1,))), random.random(), int(np.random.randint(0, 1 << 30))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for i in range(N):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.png").write_bytes(bytes([i % 251 + 1]) * (i + 3))
    return tmp_path


@pytest.fixture
def jpegs(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(24):
        d = tmp_path / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (48 + i, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        (d / f"{i:03d}.jpg").write_bytes(buf.getvalue())
    return tmp_path


def _epochs(loader: Any, epochs: list[int] | int, sampler: Any = None) -> tuple[list[Any], list[int]]:
    """Every batch of each epoch (as nested lists), and the batches built ahead in each."""
    out, built, before = [], [], 0
    for epoch in epochs if isinstance(epochs, list) else range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        out.append([_plain(batch) for batch in loader])
        now = loader.stats().batches_built_ahead
        built.append(now - before)
        before = now
    return out, built


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _loader(ds: FolderDataset, across: bool, **kw: Any) -> Any:
    torch.manual_seed(11)  # the workers' base seed, drawn from torch's global generator
    loader = ds.dataloader(batch_size=4, num_workers=2, persistent_workers=True, **kw)
    loader._planner.across_epochs = across
    return loader


@pytest.mark.timeout(180)
def test_keyed_crops_built_ahead_equal_those_made_on_demand(jpegs: Path) -> None:
    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(jpegs, transform=RandomResizedCrop(16))
        gen = torch.Generator().manual_seed(3)
        return _epochs(_loader(ds, across, shuffle=True, generator=gen), 3)

    built_run, built = run(True)
    on_demand, none = run(False)
    # Each worker's first batch of epochs 2 and 3 was built while it waited, and is the same pixels.
    assert built == [0, 2, 2] and none == [0, 0, 0]
    assert built_run == on_demand and built_run[1] != built_run[2]


@pytest.mark.timeout(180)
def test_global_generators_draw_as_if_nothing_was_built_ahead(folder: Path) -> None:
    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(folder, loader=_sum_loader, transform=_global_draws)
        return _epochs(_loader(ds, across, shuffle=True, generator=torch.Generator().manual_seed(5)), 3)

    built_run, built = run(True)
    on_demand, _ = run(False)
    assert built == [0, 2, 2]
    assert built_run == on_demand


@pytest.mark.timeout(180)
def test_a_wrong_guess_drops_the_built_batch_and_its_draws(folder: Path) -> None:
    """Epochs 0, 1, 5, 6: the next epoch is guessed 1 (right), 2 and 9 (wrong). A dropped batch's draws
    from the global generators are put back, so every epoch equals the run that built nothing."""

    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(folder, loader=_sum_loader, transform=_global_draws)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
        return _epochs(_loader(ds, across, sampler=sampler), [0, 1, 5, 6], sampler)

    built_run, built = run(True)
    on_demand, _ = run(False)
    assert built == [0, 2, 0, 0]
    assert built_run == on_demand


@pytest.mark.timeout(180)
def test_a_bad_sample_in_a_built_batch_is_reported_when_served(folder: Path) -> None:
    (folder / "c0" / "00-bad.png").write_bytes(b"x")  # sorts first: sample 0, in worker 0's first batch

    def strict_loader(f: Any) -> int:
        data = f.read()
        if data == b"x":
            raise ValueError("not a sample")
        return int(np.frombuffer(data, np.uint8).sum())

    ds = FolderDataset(folder, loader=strict_loader, on_error="skip")
    bad_url = ds._manifest.url(0)
    assert bad_url.endswith("/c0/00-bad.png")
    out, built = _epochs(_loader(ds, True), 3)  # in order: every epoch the same batches
    # Built ahead, worker 0's first batch was dropped at the bad sample and made again when asked
    # for (the sample skipped and reported once per epoch); worker 1's was used.
    assert built == [0, 1, 1]
    assert [len(batch[1]) for batch in out[1][:2]] == [3, 4]
    assert [url for url, _ in ds.errors] == [bad_url] * 3
    assert out[0] == out[1] == out[2]


def test_the_next_epochs_seed_travels_with_its_order() -> None:
    channel = PlanChannel()
    plan = channel.publish([[3, 1], [2]])
    worker = PlanChannel(channel.path)
    seen = worker.current()
    assert seen is not None
    channel.publish_next(plan.seq, [[0], [1, 2]], (1 << 64) - 5)  # a uint64 seed, past int64's range
    upcoming = worker.next_of(seen)
    assert upcoming is not None and upcoming.seed == (1 << 64) - 5 and upcoming.batch(1).tolist() == [1, 2]
    channel.publish_next(plan.seq, [[0]])
    fresh = PlanChannel(channel.path).current()
    assert fresh is not None
    again = PlanChannel(channel.path).next_of(fresh)
    assert again is not None and again.seed is None

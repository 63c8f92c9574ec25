"""An epoch's start without re-planning (#33): known samplers' batches are computed as numpy arrays with
the sampler's own draws, and with persistent workers the next epoch's batches, predicted during the
epoch, are that epoch's when it begins from the sampler state they were predicted from. Either way the
batches are exactly a plain DataLoader's, a changed sampler state falls back to iterating the sampler,
and the digest of the indices served is the same as with lists."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

import blobdata
from blobdata import ElasticDistributedSampler, FolderDataset, PartitionedSampler
from blobdata._fetch import PackedBatches
from blobdata._sampling import NextEpoch, ServedDigest
from tests.support.id_folders import id_dataset

N = 37
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path, N)


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _batches(loader: Any) -> list[list[int]]:
    return [b[0].tolist() for b in loader]


def _unpack(flat: np.ndarray, offsets: np.ndarray) -> list[list[int]]:
    return [flat[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]


SAMPLERS: dict[str, Callable[[Any], Any]] = {
    "random": lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(3)),
    "sequential": lambda ds: SequentialSampler(ds),
    "distributed": lambda ds: DistributedSampler(ds, num_replicas=3, rank=2, seed=5),
    "elastic": lambda ds: ElasticDistributedSampler(ds, num_replicas=3, rank=2, seed=5),
    "partitioned": lambda ds: PartitionedSampler(ds, num_replicas=4, rank=1, seed=5, nproc_per_node=2),
}


@pytest.mark.parametrize("drop_last", [False, True])
def test_arrays_are_the_batch_samplers_batches_with_the_same_draws(drop_last: bool) -> None:
    """NextEpoch.order draws what iterating the batch sampler draws: the same batches, and a generator
    left in the same state; sizes not divisible by the ranks or the batch, samples drawn with
    replacement or more than the dataset holds included."""
    makers: list[Callable[[], Any]] = [
        *(lambda make=make: make(_Sized(101)) for make in SAMPLERS.values()),
        lambda: RandomSampler(_Sized(50), num_samples=123, generator=torch.Generator().manual_seed(1)),
        lambda: RandomSampler(_Sized(50), replacement=True, generator=torch.Generator().manual_seed(1)),
        lambda: DistributedSampler(_Sized(101), num_replicas=8, rank=7, shuffle=False, drop_last=drop_last),
        lambda: DistributedSampler(_Sized(3), num_replicas=8, rank=5, seed=2),  # padded more than once
    ]
    for make in makers:
        ours, theirs = make(), make()
        for _epoch in range(2):
            got = NextEpoch().order(BatchSampler(ours, 7, drop_last))
            assert got is not None
            assert _unpack(*got) == list(BatchSampler(theirs, 7, drop_last)), ours
            if isinstance(ours, RandomSampler):
                assert torch.equal(ours.generator.get_state(), theirs.generator.get_state())
            elif hasattr(ours, "set_epoch"):
                ours.set_epoch(ours.epoch + 1)
                theirs.set_epoch(theirs.epoch + 1)
    # Without a generator, RandomSampler draws its seed from torch's: the same draw either way.
    torch.manual_seed(11)
    got = NextEpoch().order(BatchSampler(RandomSampler(_Sized(20)), 3, False))
    torch.manual_seed(11)
    assert got is not None and _unpack(*got) == list(BatchSampler(RandomSampler(_Sized(20)), 3, False))
    assert NextEpoch().order(BatchSampler(range(5), 2, False)) is None  # a sampler of a kind not known here


def test_packed_batches_read_and_slice_like_the_lists() -> None:
    lists = [[5, 1, 4], [0, 2], [3]]
    flat, offsets = np.array([5, 1, 4, 0, 2, 3]), np.array([0, 3, 5, 6])
    packed = PackedBatches(flat, offsets)
    assert len(packed) == 3 and [b.tolist() for b in packed] == lists and packed[-1].tolist() == [3]
    assert [b.tolist() for b in packed[1:]] == lists[1:] and len(packed[3:]) == 0
    with pytest.raises(IndexError):
        packed[3]
    digest, same = ServedDigest(), ServedDigest()
    for a, b in zip(packed, lists, strict=True):
        digest.update(2, a)
        same.update(2, b)
    assert digest.state() == same.state()


def _kind_loaders(ds: FolderDataset, kind: str, workers: int) -> tuple[Any, DataLoader[Any], Any, Any]:
    ours_sampler, plain_sampler = SAMPLERS[kind](ds), SAMPLERS[kind](ds)
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": workers, "persistent_workers": workers > 0}
    ours = ds.dataloader(sampler=ours_sampler, **kw)
    plain = DataLoader(ds, sampler=plain_sampler, **kw)
    return ours, plain, ours_sampler, plain_sampler


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_persistent_workers_take_the_predicted_order_exactly(ds: FolderDataset, kind: str) -> None:
    ours, plain, a, b = _kind_loaders(ds, kind, workers=2)
    for epoch in range(4):
        if hasattr(a, "set_epoch"):
            a.set_epoch(epoch)
            b.set_epoch(epoch)
        assert _batches(ours) == _batches(plain), epoch
    # Every epoch after the first began from the state its order was predicted from.
    assert ours._planner.epochs_predicted == 3


@pytest.mark.timeout(300)
def test_the_default_shuffle_takes_the_prediction_and_stays_a_plain_dataloaders(ds: FolderDataset) -> None:
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    ours = ds.dataloader(generator=torch.Generator().manual_seed(7), **kw)
    plain = DataLoader(ds, generator=torch.Generator().manual_seed(7), **kw)
    orders = [_batches(ours) for _ in range(3)]
    assert orders == [_batches(plain) for _ in range(3)] and orders[0] != orders[1]
    assert ours._planner.epochs_predicted == 2
    # Without persistent workers each epoch's new DataLoader iterator draws its workers' base seed
    # from the same generator before the sampler runs: the prediction draws it too, and is taken.
    kw["persistent_workers"] = False
    ours = ds.dataloader(generator=torch.Generator().manual_seed(7), **kw)
    plain = DataLoader(ds, generator=torch.Generator().manual_seed(7), **kw)
    assert [_batches(ours) for _ in range(3)] == [_batches(plain) for _ in range(3)]
    assert ours._planner.epochs_predicted == 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["distributed", "elastic", "partitioned"])
def test_an_epoch_not_the_predicted_one_iterates_the_sampler(ds: FolderDataset, kind: str) -> None:
    ours, plain, a, b = _kind_loaders(ds, kind, workers=2)
    taken = []
    for epoch in (0, 1, 2, 9, 16, 16, 3):  # predicted: 1, 2, 3 (wrong), 16, 23 (wrong), 16, 3 (wrong)
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        before = ours._planner.epochs_predicted
        assert _batches(ours) == _batches(plain), epoch
        taken.append(ours._planner.epochs_predicted - before)
    assert taken == [0, 1, 1, 0, 1, 0, 0]


@pytest.mark.timeout(300)
def test_a_reseeded_generator_iterates_the_sampler(ds: FolderDataset) -> None:
    ours_gen, plain_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    kw: dict[str, Any] = {"batch_size": 5, "shuffle": True, "num_workers": 2, "persistent_workers": True}
    ours, plain = ds.dataloader(generator=ours_gen, **kw), DataLoader(ds, generator=plain_gen, **kw)
    assert _batches(ours) == _batches(plain)
    ours_gen.manual_seed(2)
    plain_gen.manual_seed(2)
    assert _batches(ours) == _batches(plain)
    assert ours._planner.epochs_predicted == 0
    assert _batches(ours) == _batches(plain)  # the state after that epoch: predicted again
    assert ours._planner.epochs_predicted == 1
    ours_gen.set_state(ours_gen.get_state())  # the same state written back: still the prediction
    assert _batches(ours) == _batches(plain)
    assert ours._planner.epochs_predicted == 2


def _take(loader: Any, epochs: int, stop_after: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    out: list[list[int]] = []
    for e in range(epochs):
        it = iter(loader)
        for k, batch in enumerate(it):
            out.append(batch[0].tolist())
            if stop_after is not None and e == epochs - 1 and k + 1 == stop_after:
                return out, loader.state_dict()
    return out, loader.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["random", "elastic"])
def test_resume_in_a_predicted_epoch_is_exact(ds: FolderDataset, kind: str) -> None:
    """Stopped in the third epoch (whose order was the prediction), resumed in a new loader: the same
    batches, the same served digest; and a loader that loads a state after predicting ignores the
    prediction made for another state."""
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}
    epoch_of = (lambda s: (lambda e: s.set_epoch(e))) if kind == "elastic" else (lambda s: (lambda e: None))

    def loader() -> tuple[Any, Callable[[int], None]]:
        sampler = SAMPLERS[kind](ds)
        return ds.dataloader(sampler=sampler, **kw), epoch_of(sampler)

    full, set_full = loader()
    want: list[list[int]] = []
    for e in range(4):
        set_full(e)
        want += _batches(full)
    assert full._planner.epochs_predicted == 3
    first, set_first = loader()
    got: list[list[int]] = []
    for e in range(3):
        set_first(e)
        part, state = _take(first, 1, stop_after=5 if e == 2 else None)
        got += part
    assert first._planner.epochs_predicted == 2
    resumed, set_resumed = loader()
    resumed.load_state_dict(state)
    got += _batches(resumed)
    set_resumed(3)
    got += _batches(resumed)
    assert got == want
    assert blobdata.compare_runs(full, resumed) == []
    # The interrupted loader itself, predicting epoch 3's order, loads the state of epoch 2's middle.
    first.load_state_dict(state)
    again = _batches(first)
    set_first(3)
    again += _batches(first)
    assert again == want[len(want) - len(again) :] and blobdata.compare_runs(full, first) == []


class _OwnBatchSampler(BatchSampler):
    """A batch sampler of a kind blobdata does not know: its batches are listed as before #33."""


@pytest.mark.timeout(300)
def test_served_digest_is_the_same_as_with_list_plans(ds: FolderDataset) -> None:
    kw: dict[str, Any] = {"num_workers": 2, "persistent_workers": True}
    arrays = ds.dataloader(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9), **kw)
    gen = torch.Generator().manual_seed(9)  # the sampler's and the loader's, as shuffle=True makes them
    lists = ds.dataloader(batch_sampler=_OwnBatchSampler(RandomSampler(ds, generator=gen), 4, False),
                          generator=gen, **kw)  # fmt: skip
    assert [_batches(arrays) for _ in range(3)] == [_batches(lists) for _ in range(3)]
    assert arrays._planner.epochs_predicted == 2 and lists._planner.epochs_predicted == 0
    assert arrays.state_dict()["served"]["batches"] == 3 * 10
    assert blobdata.compare_runs(arrays, lists) == []


@pytest.mark.timeout(120)
def test_exiting_while_the_next_epoch_is_predicted_is_clean() -> None:
    """The prediction's thread may still run in torch when the program ends: the interpreter waits for
    it rather than abort ("terminate called without an active exception", exit status 134)."""
    script = textwrap.dedent("""
        import torch
        from torch.utils.data import BatchSampler, RandomSampler
        from blobdata._fetch import PlanChannel, PlanningBatchSampler
        from blobdata._sampling import NextEpoch, ServedDigest

        class Sized:
            def __len__(self):
                return 3_000_000

        sampler = RandomSampler(Sized(), generator=torch.Generator().manual_seed(0))
        batches = BatchSampler(sampler, 256, False)
        planner = PlanningBatchSampler(batches, PlanChannel(), next_epoch=NextEpoch())
        planner.across_epochs = True
        next(iter(planner))
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=100)  # fmt: skip
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]

"""Look-ahead across an epoch's end: with persistent workers the next epoch's order is published with
the current one's, so its first batches are fetched before it begins; a wrong guess of the next order
costs fetches, never a wrong batch."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from blobdata import ElasticDistributedSampler, FolderDataset, PartitionedSampler
from blobdata._fetch import PlanChannel
from blobdata._sampling import NextEpoch
from tests.support.announce import wait_announced

N = 48


def _sum_loader(f: Any) -> int:
    return int(np.frombuffer(f.read(), np.uint8).sum())


def _png(i: int) -> bytes:
    return bytes([i % 251 + 1]) * (i + 1)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for i in range(N):
        d = tmp_path / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.png").write_bytes(_png(i))
    return tmp_path


def _staged_per_epoch(loader: Any, epochs: int, wait: bool = True) -> tuple[list[int], list[list[int]]]:
    staged, orders, before = [], [], 0
    for _ in range(epochs):
        order: list[int] = []
        for k, (batch, _) in enumerate(loader):
            if k == 0 and wait:
                wait_announced(loader)
            order.extend(int(s) for s in batch)
        orders.append(order)
        if wait:  # the workers, idle, build the next epoch's first batches now: not this epoch's count
            time.sleep(0.3)
        now = loader.stats().samples_staged
        staged.append(now - before)
        before = now
    return staged, orders


@pytest.mark.timeout(120)
def test_persistent_workers_stage_the_next_epochs_first_batches(folder: Path) -> None:
    def run(across: bool) -> tuple[list[int], list[list[int]]]:
        ds = FolderDataset(folder, loader=_sum_loader, lookahead=16)
        loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, persistent_workers=True,
                               generator=torch.Generator().manual_seed(5))  # fmt: skip
        loader._planner.across_epochs = across
        return _staged_per_epoch(loader, 3, wait=across)

    staged, orders = run(True)
    staged_per_epoch, same_orders = run(False)
    assert orders == same_orders and orders[0] != orders[1]
    # Per epoch, each worker's first batch cannot be staged (4 samples each); across epochs it is.
    assert staged_per_epoch[1] <= N - 8 and staged_per_epoch[2] <= N - 8
    # Each epoch counts the samples of its own batches that were staged, however late after its end
    # the workers built the next one's first batches (counted when they are served, not when built).
    assert staged[0] <= N - 8 and staged[1] == N and staged[2] == N


@pytest.mark.timeout(120)
def test_a_wrong_guess_of_the_next_epoch_gives_the_right_batches(folder: Path) -> None:
    ds = FolderDataset(folder, loader=_sum_loader, lookahead=16)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = ds.dataloader(batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True)
    by_index = {i: ds[i][0] for i in range(N)}
    for epoch in (0, 7, 7, 2):  # guesses 1, then 14 (step 7), then 7 (step 0): wrong, wrong, right
        sampler.set_epoch(epoch)
        got = [int(s) for batch, _ in loader for s in batch]
        want = [by_index[i] for i in sampler]
        assert got == want


def test_next_epoch_predicts_without_changing_the_sampler(folder: Path) -> None:
    ds = FolderDataset(folder, loader=_sum_loader)
    gen = torch.Generator().manual_seed(1)
    batches = BatchSampler(RandomSampler(ds, generator=gen), 5, False)
    first = list(batches)
    peek = NextEpoch()
    state = gen.get_state()
    make = peek.prepare(batches)
    assert make is not None
    assert torch.equal(gen.get_state(), state)  # a copy of the state: it may run in a thread
    flat, offsets = make()
    assert torch.equal(gen.get_state(), state)
    guess = [flat[a:b].tolist() for a, b in itertools.pairwise(offsets)]
    assert guess == list(batches) != first
    assert NextEpoch().batches(BatchSampler(SequentialSampler(ds), 5, False)) == [
        list(range(i, min(i + 5, N))) for i in range(0, N, 5)
    ]
    assert NextEpoch().batches(BatchSampler(RandomSampler(ds), 5, False)) is None  # global RNG: unknown
    for cls in (DistributedSampler, ElasticDistributedSampler, PartitionedSampler):
        sampler = cls(ds, num_replicas=2, rank=1, seed=4)
        sampler.set_epoch(3)
        if isinstance(sampler, ElasticDistributedSampler):
            sampler.start = 6  # a resumed epoch: the next one is whole again
        batch_sampler = BatchSampler(sampler, 4, False)
        guess = NextEpoch().batches(batch_sampler)
        assert sampler.epoch == 3 and getattr(sampler, "start", 6) == 6
        sampler.set_epoch(4)
        assert guess == list(batch_sampler), cls


def test_a_plan_carries_the_next_epoch_to_other_processes() -> None:
    channel = PlanChannel()
    plan = channel.publish([[3, 1], [2]])
    worker = PlanChannel(channel.path)
    seen = worker.current()
    assert seen is not None and worker.next_of(seen) is None  # not announced yet
    channel.publish_next(plan.seq + 7, [[9]])  # another plan's: not this one's next
    assert worker.next_of(seen) is None
    channel.publish_next(plan.seq, [[0], [1, 2, 3]])
    upcoming = worker.next_of(seen)
    assert upcoming is not None and upcoming.batch(1).tolist() == [1, 2, 3]
    channel.publish([[0], [1, 2, 3]])
    again = worker.current(reload=True)
    assert again is not None and again.seq == plan.seq + 1 and upcoming.same_batches(again)
    assert worker.next_of(again) is None

"""A loader with a PartitionedSampler resumes mid-epoch exactly: at the same layout it gives the
uninterrupted batches; at another number of nodes every remaining sample is read once, each node
reading what is left of its own new share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from blobdata import ConfigError, FolderDataset, PartitionedSampler
from blobdata._sampling import Layout, node_share
from tests.support.id_folders import id_dataset


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path, 100, per_class=10)


def _loader(ds: FolderDataset, layout: Layout, rank: int, workers: int = 0) -> Any:
    sampler = PartitionedSampler(
        ds, num_replicas=layout.world, rank=rank, nproc_per_node=layout.nproc, seed=5
    )
    return ds.dataloader(batch_size=4, sampler=sampler, num_workers=workers)


def _batch_ids(batch: Any) -> list[int]:
    return [int(x) for x in batch[0].tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_at_the_same_layout_gives_the_uninterrupted_batches(
    ds: FolderDataset, workers: int
) -> None:
    layout = Layout(2, 2)
    full = []
    loader = _loader(ds, layout, 3, workers)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        full += [_batch_ids(b) for b in loader]
    loader = _loader(ds, layout, 3, workers)
    first = []
    loader.sampler.set_epoch(0)
    first += [_batch_ids(b) for b in loader]
    loader.sampler.set_epoch(1)
    it = iter(loader)
    first += [_batch_ids(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["sampler"]["kind"] == "partitioned" and state["sampler"]["consumed"] == [[2, 2, 12]]
    assert len(json.dumps(state)) < 1000  # no per-sample list
    resumed = _loader(ds, layout, 3, workers)
    resumed.load_state_dict(state)
    rest = []
    for epoch in (1, 2):
        resumed.sampler.set_epoch(epoch)
        rest += [_batch_ids(b) for b in resumed]
    assert first + rest == full


def _run(ds: FolderDataset, layout: Layout, state: Any, batches: int | None) -> tuple[list[list[int]], Any]:
    """Every rank of ``layout`` in lockstep for ``batches`` batches (None: to the epoch's end), from
    ``state``; returns each node's samples read and the (rank-independent) state at the end."""
    per_node: list[list[int]] = [[] for _ in range(layout.nnodes)]
    states = []
    for rank in range(layout.world):
        loader = _loader(ds, layout, rank)
        if state is not None:
            loader.load_state_dict(state)
        loader.sampler.set_epoch(0)
        for k, batch in enumerate(loader):
            per_node[rank // layout.nproc] += _batch_ids(batch)
            if batches is not None and k + 1 == batches:
                break
        states.append(json.loads(json.dumps(loader.state_dict())))
    # The position is rank-independent; the digest of the indices served is each rank's own.
    assert all({**s, "served": None} == {**states[0], "served": None} for s in states)
    return per_node, states[0]


@pytest.mark.parametrize(
    "layouts",
    [(Layout(4, 1), Layout(2, 1)), (Layout(2, 2), Layout(4, 2)), (Layout(4, 2), Layout(2, 1), Layout(3, 1))],
)
def test_resume_at_another_layout_reads_each_remaining_sample_once_from_the_new_shares(
    ds: FolderDataset, layouts: tuple[Layout, ...]
) -> None:
    state = None
    seen: list[int] = []
    for lay in layouts[:-1]:
        per_node, state = _run(ds, lay, state, batches=2)
        seen += [i for node in per_node for i in node]
    last = layouts[-1]
    per_node, end = _run(ds, last, state, batches=None)
    rest = [i for node in per_node for i in node]
    assert end["complete"]
    assert set(seen) | set(rest) == set(range(100)) and not set(seen) & set(rest)
    assert len(rest) - len(set(rest)) < last.world  # only DistributedSampler-like padding repeats
    for node, got in enumerate(per_node):  # each node reads (almost only) its own new share
        share = set(node_share(100, seed=5, nnodes=last.nnodes, node=node).tolist())
        foreign = len(set(got) - share)
        assert foreign <= (0 if len(layouts) == 2 and layouts[0].nnodes % last.nnodes == 0 else 8)


def test_a_state_from_another_sampler_setting_is_refused(ds: FolderDataset) -> None:
    loader = _loader(ds, Layout(2, 1), 0)
    loader.sampler.set_epoch(0)
    next(iter(loader))
    state = loader.state_dict()
    other = ds.dataloader(
        batch_size=4, sampler=PartitionedSampler(ds, num_replicas=2, rank=0, nproc_per_node=1, seed=6)
    )
    with pytest.raises(ConfigError, match="seed"):
        other.load_state_dict(state)
    mixed = ds.dataloader(
        batch_size=4,
        sampler=PartitionedSampler(ds, num_replicas=2, rank=0, nproc_per_node=1, seed=5, mix=0.1),
    )
    with pytest.raises(ConfigError, match="mix"):
        mixed.load_state_dict(state)


def test_dataloader_shorthand_makes_the_jobs_partitioned_sampler(
    ds: FolderDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them, on node 1 of 2
    loader = ds.dataloader(batch_size=4, sampler="partitioned")
    sampler = loader.sampler
    assert isinstance(sampler, PartitionedSampler)
    assert (sampler.nnodes, sampler.node_rank, sampler.local_rank, sampler.shuffle) == (2, 1, 1, True)
    sampler.set_epoch(0)
    got = [i for b in loader for i in _batch_ids(b)]
    assert got == sampler.indices().tolist() and set(got) <= set(
        node_share(100, seed=0, nnodes=2, node=1).tolist()
    )
    assert ds.dataloader(batch_size=4, sampler="partitioned", shuffle=False).sampler.shuffle is False
    with pytest.raises(ConfigError, match="partitioned"):
        ds.dataloader(batch_size=4, sampler="random")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_partitioned_sampler_the_loader_made_moves_on_each_epoch(ds: FolderDataset, workers: int) -> None:
    """``sampler="partitioned"`` is the loader's own: a loop that never calls ``set_epoch`` still gets
    epoch 0, 1, 2 (not epoch 0 three times); one that does (written for DistributedSampler) keeps its
    epochs; a resumed loader goes on from the state's epoch."""
    kw: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
    loader = ds.dataloader(batch_size=4, sampler="partitioned", **kw)
    orders = [[i for b in loader for i in _batch_ids(b)] for _ in range(3)]
    mine = PartitionedSampler(ds, shuffle=True)
    want = []
    for epoch in range(3):
        mine.set_epoch(epoch)
        want.append(mine.indices().tolist())
    assert orders == want and want[0] != want[1]
    assert loader.sampler.epoch == 2 and loader._planner.epochs_predicted == (2 if workers else 0)

    told = ds.dataloader(batch_size=4, sampler="partitioned", num_workers=workers)
    for epoch in (5, 5, 9):  # the user's set_epoch calls win, a repeated one included
        told.sampler.set_epoch(epoch)
        mine.set_epoch(epoch)
        assert [i for b in told for i in _batch_ids(b)] == mine.indices().tolist()

    # Stopped after 3 batches of epoch 1, resumed: the rest of epoch 1, then epoch 2.
    first = ds.dataloader(batch_size=4, sampler="partitioned", num_workers=workers)
    list(first)  # epoch 0
    it = iter(first)
    [next(it) for _ in range(3)]
    state = first.state_dict()
    del it
    again = ds.dataloader(batch_size=4, sampler="partitioned", num_workers=workers)
    again.load_state_dict(state)
    rest = [i for b in again for i in _batch_ids(b)]
    assert rest == want[1][12:]
    assert [i for b in again for i in _batch_ids(b)] == want[2]

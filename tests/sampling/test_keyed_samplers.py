"""The samplers compute a rank's samples at that rank's positions only: the same samples as the node's
whole order dealt round-robin, a plan whose memory does not grow with the dataset (10^10 samples on a
million ranks), and ElasticDistributedSampler's keyed order, which covers each epoch once, resumes at
another world size and is refused by a state saved with the other order."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from blobdata import ConfigError, ElasticDistributedSampler, FolderDataset, PartitionedSampler
from blobdata._sampling import Layout, epoch_orders, rank_indices, rank_stream
from tests.support.id_folders import id_dataset


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mix", [0.0, 0.3])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "nnodes", "nproc"), [(1003, 4, 2), (7, 4, 2), (3, 4, 1), (5000, 3, 4)])
def test_a_ranks_samples_are_its_nodes_order_dealt_round_robin(
    n: int, nnodes: int, nproc: int, mix: float, drop_last: bool, shuffle: bool
) -> None:
    layout = Layout(nnodes, nproc)
    kw: dict[str, Any] = {"seed": 9, "shuffle": shuffle, "mix": mix, "drop_last": drop_last}
    for epoch in (0, 3):
        orders = epoch_orders(n, epoch=epoch, layout=layout, **kw)
        for node in range(nnodes):
            for local in range(nproc):
                mine = rank_indices(n, epoch=epoch, layout=layout, node=node, local_rank=local, **kw)
                assert mine.tolist() == rank_stream(orders[node], nproc, local).tolist()
        # A resume at the same layout goes on where each rank stopped.
        per_rank = len(orders[0]) // nproc
        consumed = [(layout, per_rank // 3), (layout, per_rank // 4)]
        later = epoch_orders(n, epoch=epoch, layout=layout, consumed=consumed, **kw)
        cut = nproc * (per_rank // 3 + per_rank // 4)
        for node in range(nnodes):
            assert later[node].tolist() == orders[node][cut:].tolist()
            mine = rank_indices(n, epoch=epoch, layout=layout, node=node, local_rank=1 % nproc,
                                consumed=consumed, **kw)  # fmt: skip
            assert mine.tolist() == rank_stream(orders[node][cut:], nproc, 1 % nproc).tolist()


def test_seeds_and_epochs_give_other_orders_and_shares() -> None:
    def node(seed: int, epoch: int) -> list[int]:  # node 2's ranks 4 and 5, one after the other
        out = []
        for rank in (4, 5):
            s = PartitionedSampler(Sized(10_000), num_replicas=8, rank=rank, nproc_per_node=2, seed=seed)
            s.set_epoch(epoch)
            out += list(s)
        return out

    runs = {(seed, epoch): node(seed, epoch) for seed in range(3) for epoch in range(3)}
    assert len({tuple(r) for r in runs.values()}) == 9
    for seed in range(3):  # the node's share is fixed by the seed: the same set every epoch
        assert len({frozenset(runs[seed, e]) for e in range(3)}) == 1
    assert len(set(runs[0, 0]) & set(runs[1, 0])) < 0.5 * len(runs[0, 0])  # another seed, another share


def test_a_ranks_plan_does_not_grow_with_the_dataset() -> None:
    """10^10 samples on 1000 nodes x 1000 ranks: a rank's 10,000 samples come without the dataset's
    permutation (80 GB as int64); they are distinct, in range, and from the node's own share."""
    n = 10**10
    s = PartitionedSampler(Sized(n), num_replicas=10**6, rank=123_457, nproc_per_node=1000, seed=1)
    s.set_epoch(4)
    mine = s.indices()
    assert len(mine) == len(s) == 10_000 and len(set(mine.tolist())) == 10_000
    assert int(mine.min()) >= 0 and int(mine.max()) < n
    neighbour = PartitionedSampler(Sized(n), num_replicas=10**6, rank=123_458, nproc_per_node=1000, seed=1)
    neighbour.set_epoch(4)
    assert not set(mine.tolist()) & set(neighbour.indices().tolist())  # the same node: disjoint ranks
    e = ElasticDistributedSampler(Sized(n), num_replicas=10**6, rank=999_999, seed=1, permutation="keyed")
    e.set_epoch(2)
    got = e.indices()
    assert len(got) == len(e) == 10_000 and len(set(got.tolist())) == 10_000 and int(got.max()) < n


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "world"), [(1000, 4), (1001, 8), (7, 3), (2, 5)])
def test_keyed_elastic_sampler_covers_each_epoch_once(n: int, world: int, drop_last: bool) -> None:
    orders = []
    for epoch in (0, 1):
        streams = []
        for rank in range(world):
            s = ElasticDistributedSampler(
                Sized(n), world, rank, seed=3, drop_last=drop_last, permutation="keyed"
            )
            s.set_epoch(epoch)
            streams.append(list(s))
            assert len(streams[-1]) == len(s)
        counts = collections.Counter(i for st in streams for i in st)
        if drop_last:
            assert max(counts.values(), default=1) == 1 and n - len(counts) < world
        else:
            assert set(counts) == set(range(n)) and sum(counts.values()) - n < world
        orders.append(streams[0])
        whole = ElasticDistributedSampler(Sized(n), 1, 0, seed=3, permutation="keyed")
        whole.set_epoch(epoch)
        assert sorted(whole.global_order()) == list(range(n))
    if n >= 1000:
        assert orders[0] != orders[1]  # another epoch, another order
    with pytest.raises(ConfigError, match="permutation"):
        ElasticDistributedSampler(Sized(n), 1, 0, permutation="numpy")


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path, 48)


def _loader(ds: FolderDataset, world: int, rank: int, permutation: str = "keyed") -> Any:
    sampler = ElasticDistributedSampler(ds, num_replicas=world, rank=rank, seed=5, permutation=permutation)
    return ds.dataloader(batch_size=4, sampler=sampler, num_workers=0)


def _ids(batch: Any) -> list[int]:
    return [int(x) for x in batch[0].tolist()]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_keyed_elastic_resume_at_another_world_size_sees_the_rest_once(
    ds: FolderDataset, before: int, after: int
) -> None:
    seen: list[int] = []
    states = []
    for r in range(before):  # in lockstep: every rank 3 batches
        loader = _loader(ds, before, r)
        loader.sampler.set_epoch(0)
        it = iter(loader)
        for _ in range(3):
            seen += _ids(next(it))
        states.append(json.loads(json.dumps(loader.state_dict())))
    # The position is rank-independent; the digest of the indices served is each rank's own (issue 33).
    assert all({**s, "served": None} == {**states[0], "served": None} for s in states)
    assert states[0]["sampler"]["permutation"] == "keyed"
    rest: list[int] = []
    for r in range(after):
        loader = _loader(ds, after, r)
        loader.load_state_dict(states[0])
        loader.sampler.set_epoch(0)
        rest += [i for b in loader for i in _ids(b)]
    assert sorted(seen + rest) == list(range(48))
    with pytest.raises(ConfigError, match="permutation='keyed'"):
        _loader(ds, after, 0, permutation="torch").load_state_dict(states[0])

"""PartitionedSampler: each node reads the same random share of the dataset every epoch, its ranks split
it, the order changes every epoch, every epoch covers the dataset once, and a loader resumes exactly,
also at another number of nodes."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch

from blobdata import ConfigError, PartitionedSampler
from blobdata._sampling import Layout, epoch_orders, fixed_order, node_share


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _streams(n: int, nnodes: int, nproc: int, epoch: int = 0, **kw: Any) -> list[list[int]]:
    """Every rank's samples for ``epoch``, rank by rank."""
    out = []
    for rank in range(nnodes * nproc):
        s = PartitionedSampler(Sized(n), num_replicas=nnodes * nproc, rank=rank, nproc_per_node=nproc, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
        assert len(out[-1]) == len(s)
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(
    ("n", "nnodes", "nproc"), [(1000, 4, 2), (1003, 4, 2), (997, 3, 3), (50, 8, 4), (7, 4, 2)]
)
def test_every_epoch_covers_the_dataset_once_in_equal_rank_shares(
    n: int, nnodes: int, nproc: int, drop_last: bool
) -> None:
    world = nnodes * nproc
    for epoch in (0, 1):
        streams = _streams(n, nnodes, nproc, epoch, drop_last=drop_last)
        lengths = {len(s) for s in streams}
        assert lengths == {n // world if drop_last else -(-n // world)}  # DistributedSampler's num_samples
        counts = collections.Counter(i for s in streams for i in s)
        if drop_last:  # at most world - 1 samples left out, none twice
            assert max(counts.values(), default=1) == 1 and n - len(counts) < world
        else:  # every sample, and at most world - 1 padded repeats
            assert set(counts) == set(range(n)) and sum(counts.values()) - n < world


def test_a_nodes_share_is_fixed_a_random_mix_and_padding_stays_in_it() -> None:
    n, nnodes, nproc, classes = 1003, 4, 2, 10
    label = np.arange(n) * classes // n  # a listing sorted by class: contiguous blocks
    shares = []
    for node in range(nnodes):
        share = set(node_share(n, seed=3, nnodes=nnodes, node=node).tolist())
        shares.append(share)
        assert len(set(label[list(share)])) == classes  # every class in every share: not index ranges
        for epoch in range(4):
            streams = _streams(n, nnodes, nproc, epoch, seed=3)
            read = {i for s in streams[node * nproc : (node + 1) * nproc] for i in s}
            assert read == share  # the same samples, padded ones included, every epoch
    assert sorted(i for s in shares for i in s) == list(range(n))  # the shares partition the dataset
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    s = PartitionedSampler(Sized(n), num_replicas=8, rank=5, nproc_per_node=2, seed=3)
    assert set(s.share().tolist()) == shares[2] and (s.node_rank, s.local_rank) == (2, 1)
    other = set(node_share(n, seed=4, nnodes=nnodes, node=2).tolist())
    assert len(other & shares[2]) < len(shares[2]) * 0.5  # the seed decides the shares


def test_the_order_changes_every_epoch_and_only_with_the_epoch() -> None:
    a = [_streams(400, 2, 2, epoch)[1] for epoch in range(3)]
    assert a[0] != a[1] != a[2] and a[0] != a[2]
    assert sorted(a[0]) != a[0]  # shuffled
    assert _streams(400, 2, 2, 1)[1] == a[1]  # reproducible
    plain = _streams(400, 2, 2, 0, shuffle=False)[1]
    assert plain == sorted(plain) == _streams(400, 2, 2, 5, shuffle=False)[1]


def test_each_ranks_first_batches_mix_the_classes() -> None:
    """A class-sorted listing of 100 classes x 100 samples on 16 nodes x 2 ranks: each rank's first
    batches hold many classes (a share of index ranges would hold about 3 classes per node)."""
    n, classes, batch = 10_000, 100, 32
    label = np.arange(n) // (n // classes)
    for stream in _streams(n, 16, 2, epoch=2):
        for b in range(3):
            seen = set(label[stream[b * batch : (b + 1) * batch]].tolist())
            assert len(seen) >= 20, seen  # ~27 expected for 32 draws among 100 classes


def test_canonical_shares_merge_and_split_when_the_node_count_changes() -> None:
    n = 1001
    four = [set(node_share(n, seed=0, nnodes=4, node=j).tolist()) for j in range(4)]
    two = [set(node_share(n, seed=0, nnodes=2, node=j).tolist()) for j in range(2)]
    eight = [set(node_share(n, seed=0, nnodes=8, node=j).tolist()) for j in range(8)]
    assert two[0] == four[0] | four[1] and two[1] == four[2] | four[3]  # 4 -> 2: unions
    for j in range(8):
        assert eight[j] <= four[j // 2]  # 4 -> 8: parts
    # The sampler takes num_canonical_nodes: 4 canonical shares on 2 nodes are the same unions.
    s = PartitionedSampler(Sized(n), num_replicas=2, rank=1, nproc_per_node=1, num_canonical_nodes=4)
    assert set(s.share().tolist()) == four[2] | four[3]
    canonical = fixed_order(n, 0)
    assert set(canonical[2 * n // 4 : 3 * n // 4].tolist()) == four[2]
    with pytest.raises(ConfigError, match="multiple or a divisor"):
        PartitionedSampler(Sized(n), num_replicas=3, rank=0, nproc_per_node=1, num_canonical_nodes=4)


def test_bad_arguments_are_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="nproc_per_node=3"):
        PartitionedSampler(Sized(10), num_replicas=4, rank=0, nproc_per_node=3)
    with pytest.raises(ConfigError, match="mix"):
        PartitionedSampler(Sized(10), num_replicas=4, rank=0, nproc_per_node=2, mix=1.5)
    with pytest.raises(ConfigError, match="rank 4"):
        PartitionedSampler(Sized(10), num_replicas=4, rank=4, nproc_per_node=2)
    # nproc_per_node defaults to torchrun's LOCAL_WORLD_SIZE, else one node of every rank.
    assert PartitionedSampler(Sized(10), num_replicas=4, rank=3).nnodes == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = PartitionedSampler(Sized(10), num_replicas=4, rank=3)
    assert (s.nnodes, s.node_rank, s.local_rank, s.num_canonical_nodes) == (2, 1, 1, 2)


def test_mix_exchanges_that_fraction_of_each_share_per_epoch() -> None:
    n, nnodes, nproc = 4000, 4, 2
    for epoch in (0, 1):
        streams = _streams(n, nnodes, nproc, epoch, mix=0.25)
        counts = collections.Counter(i for s in streams for i in s)
        assert set(counts) == set(range(n)) and sum(counts.values()) == n
        for node in range(nnodes):
            share = set(node_share(n, seed=0, nnodes=nnodes, node=node).tolist())
            read = {i for s in streams[node * nproc : (node + 1) * nproc] for i in s}
            outside = len(read - share) / len(read)
            assert 0.15 < outside <= 0.25  # movers come back to their own node with chance 1/4
    e0 = _streams(n, nnodes, nproc, 0, mix=0.25)[0]
    e1 = _streams(n, nnodes, nproc, 1, mix=0.25)[0]
    assert set(e0) != set(e1)  # exchanged afresh each epoch


def test_epoch_orders_at_scale_are_vectorised() -> None:
    """ImageNet's 1.28 M samples on 16 nodes x 8 ranks: one node's epoch is one sort of its share."""
    n = 1_281_167
    (order,) = epoch_orders(n, seed=0, epoch=1, layout=Layout(16, 8), nodes=[3])
    assert len(order) == 8 * -(-n // 128)
    assert set(order.tolist()) == set(node_share(n, seed=0, nnodes=16, node=3).tolist())
    torch.manual_seed(0)  # the sampler draws nothing from torch's RNG
    before = torch.get_rng_state()
    s = PartitionedSampler(Sized(n), num_replicas=128, rank=29, nproc_per_node=8)
    s.set_epoch(1)
    assert s.indices().tolist() == order[5::8].tolist()
    assert torch.equal(before, torch.get_rng_state())

"""A mixture's epoch is an exact plan (issue 41): largest-remainder counts, draws that cycle each source,
an even interleave, dealt to ranks as DistributedSampler deals, resumable at another world size and with
other weights; bad input refused naming the source. Local folders only (the servers: test_mixture.py)."""

from __future__ import annotations

import collections
import json
import math
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data.distributed import DistributedSampler

from blobdata import ConfigError, FolderDataset, Mixture, MixtureSampler
from blobdata._sampling import largest_remainder
from blobdata._sampling.mixing import Draws, weighted
from tests.support.id_folders import sample_id

SIZES = {"a": 30, "b": 50, "c": 7}
BASE = {"a": 0, "b": 1000, "c": 2000}  # a sample's id says its source: 0.., 1000.., 2000..


def id_folder(root: Path, ids: range) -> FolderDataset:
    for i in ids:
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.png").write_bytes(b"x")
    return FolderDataset(root, loader=sample_id)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FolderDataset]:
    root = tmp_path_factory.mktemp("mix")
    return {name: id_folder(root / name, range(BASE[name], BASE[name] + n)) for name, n in SIZES.items()}


def mixture(sources: dict[str, FolderDataset], weights: dict[str, float], **kw: Any) -> Mixture:
    return Mixture(sources, weights, **kw)


def hamilton(weights: list[float], total: int) -> list[int]:
    """Largest remainder (Hamilton's method) in exact arithmetic; ties to the earlier source."""
    w = [Fraction(x) for x in weights]
    quotas = [x / sum(w) * total for x in w]
    counts = [math.floor(q) for q in quotas]
    order = sorted((i for i in range(len(w)) if w[i] > 0), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=1, max_size=6).filter(any),
    st.integers(0, 5000),
)
def test_counts_are_the_largest_remainder_of_the_weights(weights: list[int], total: int) -> None:
    assert largest_remainder([float(w) for w in weights], total).tolist() == hamilton(weights, total)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(0, 20)), min_size=1, max_size=5).filter(
        lambda xs: any(w for _, w in xs)
    ),
    st.integers(1, 2000),
    st.integers(0, 3),
)
def test_an_epoch_is_exact_and_even(sources: list[tuple[int, int]], total: int, seed: int) -> None:
    """Per source: exactly its count; each of its samples floor(c/n) or ceil(c/n) times; any run of
    positions within less than the number of sources of its share."""
    sizes = [n for n, _ in sources]
    weights = tuple(float(w) for _, w in sources)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    draws = Draws(sizes, offsets.tolist(), list(range(len(sizes))), seed=seed, epoch=1, shuffle=True)
    plan, which = weighted(total, weights, draws)
    assert (np.searchsorted(offsets, plan, side="right") - 1).tolist() == which.tolist()
    counts = hamilton(list(weights), total)
    for s, (n, c) in enumerate(zip(sizes, counts, strict=True)):
        mine = plan[which == s] - offsets[s]
        assert len(mine) == c
        times = np.bincount(mine, minlength=n)
        assert set(times.tolist()) <= {c // n, -(-c // n)}
        ones = np.concatenate([[0], np.cumsum(which == s)])
        for m in (8, 64):
            if m <= total:
                assert np.abs(ones[m:] - ones[:-m] - m * c / total).max() < len(sizes)


def test_the_plan_is_a_function_of_seed_epoch_weights_and_sources(sources: dict[str, FolderDataset]) -> None:
    mix = mixture(sources, {"a": 1, "b": 2, "c": 1}, seed=3)
    sampler = MixtureSampler(mix, num_replicas=1, rank=0)
    first = sampler.global_order()
    assert first == MixtureSampler(mixture(sources, {"a": 2, "b": 4, "c": 2}, seed=3), num_replicas=1,
                                   rank=0).global_order()  # fmt: skip
    sampler.set_epoch(1)
    assert sampler.global_order() != first
    assert MixtureSampler(mixture(sources, {"a": 1, "b": 2, "c": 1}, seed=4), num_replicas=1,
                          rank=0).global_order() != first  # fmt: skip
    assert MixtureSampler(mixture(sources, {"a": 1, "b": 3, "c": 1}, seed=3), num_replicas=1,
                          rank=0).global_order() != first  # fmt: skip


def test_a_weight_of_0_leaves_a_source_out_and_the_default_epoch(sources: dict[str, FolderDataset]) -> None:
    """The default samples_per_epoch is the sum of the sizes of the sources with a positive weight."""
    mix = mixture(sources, {"a": 1, "b": 0, "c": 1})
    assert mix.samples_per_epoch == SIZES["a"] + SIZES["c"]
    order = MixtureSampler(mix, num_replicas=1, rank=0).global_order()
    assert len(order) == 37 and {mix.source_of(i)[0] for i in order} == {"a", "c"}
    assert collections.Counter(mix.source_of(i)[0] for i in order) == {"a": 19, "c": 18}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_read_the_epoch_in_blocks_padded_or_cut_as_distributed_sampler_does(
    sources: dict[str, FolderDataset], world: int, drop_last: bool
) -> None:
    """Torch's DistributedSampler (shuffle=False) over the epoch's 91 positions says how it is padded
    (or cut); rank r reads block r of that. 2 ranks of an even epoch are disjoint, their union is the
    1-rank epoch, and each rank's batches follow the weights (round-robin dealing of a 1:1 even
    interleave would give each rank one source)."""
    mix = mixture(sources, {"a": 1, "b": 1, "c": 0}, samples_per_epoch=91, seed=1)
    whole = MixtureSampler(mix, num_replicas=1, rank=0).global_order()
    theirs = [
        list(DistributedSampler(range(91), num_replicas=world, rank=r, shuffle=False, drop_last=drop_last))
        for r in range(world)
    ]
    per = len(theirs[0])
    padded = [theirs[k % world][k // world] for k in range(world * per)]  # DistributedSampler's positions
    for r in range(world):
        sampler = MixtureSampler(mix, num_replicas=world, rank=r, drop_last=drop_last)
        assert list(sampler) == [whole[p] for p in padded[r * per : (r + 1) * per]]
        assert len(sampler) == per
        mine = [mix.source_of(i)[0] for i in sampler]
        for k in range(0, per - 8, 8):  # every batch of 8: 4 of each source, to within one
            assert abs(mine[k : k + 8].count("a") - 4) <= 1


def test_two_ranks_are_disjoint_and_their_union_is_the_one_rank_epoch(
    sources: dict[str, FolderDataset],
) -> None:
    mix = mixture(sources, {"a": 1, "b": 2, "c": 1}, samples_per_epoch=90, seed=1)
    whole = MixtureSampler(mix, num_replicas=1, rank=0).global_order()
    ranks = [list(MixtureSampler(mix, num_replicas=2, rank=r)) for r in range(2)]
    assert not set(ranks[0]) & set(ranks[1]) or collections.Counter(
        ranks[0] + ranks[1]
    ) == collections.Counter(whole)
    assert collections.Counter(ranks[0] + ranks[1]) == collections.Counter(whole)


def test_the_ranks_default_to_torchruns(
    sources: dict[str, FolderDataset], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a process group, ``mix.dataloader()`` deals the epoch to the rank torchrun's variables
    name (here rank 3 of 4, on node 1 of 2), as blobdata's other samplers do."""
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    mix = mixture(sources, {"a": 1, "b": 2, "c": 1}, samples_per_epoch=90, seed=1)
    sampler = mix.dataloader(batch_size=5).sampler
    assert (sampler.num_replicas, sampler.rank) == (4, 3)
    assert list(sampler) == list(MixtureSampler(mix, num_replicas=4, rank=3))
    by_node = mix.dataloader(batch_size=5, sampler="partitioned").sampler
    assert (by_node.nnodes, by_node.node_rank, by_node.local_rank) == (2, 1, 1)
    assert list(by_node) == list(MixtureSampler(mix, num_replicas=4, rank=3, by_node=True, nproc_per_node=2))


def test_by_node_each_node_reads_its_own_shares(sources: dict[str, FolderDataset]) -> None:
    """Two nodes of two ranks: a source larger than the nodes is split between them (node caches add
    up), each node's part follows the weights exactly, and its ranks read different samples."""
    mix = mixture(sources, {"a": 1, "b": 1, "c": 2}, samples_per_epoch=100)
    nodes: list[set[int]] = []
    for node in range(2):
        ranks = [
            list(MixtureSampler(mix, num_replicas=4, rank=node * 2 + lr, by_node=True, nproc_per_node=2))
            for lr in range(2)
        ]
        assert len(ranks[0]) == len(ranks[1]) == 25
        once = [{i for i in r if mix.source_of(i)[0] != "c"} for r in ranks]  # c (7 samples) is read 25 times
        assert not once[0] & once[1]
        part = ranks[0] + ranks[1]
        assert collections.Counter(mix.source_of(i)[0] for i in part) == dict(
            zip("abc", hamilton([1, 1, 2], 50), strict=True)
        )
        nodes.append(set(part))
    by_source = [{s: {i for i in n if mix.source_of(i)[0] == s} for s in "abc"} for n in nodes]
    for s in "abc":  # each node reads its own share of every source
        assert not by_source[0][s] & by_source[1][s]
    # c's count (25 a node) is more than its share (3 or 4): the two shares are the whole source
    assert by_source[0]["c"] | by_source[1]["c"] == {i for i in range(len(mix)) if mix.source_of(i)[0] == "c"}


def _state_after(
    mix: Mixture, world: int, batches: int, batch_size: int = 4
) -> tuple[dict[str, Any], list[int]]:
    """Each of ``world`` ranks reads ``batches`` batches; rank 0's state (JSON), and what they all read."""
    read: list[int] = []
    state: dict[str, Any] = {}
    for r in range(world):
        loader = mix.dataloader(
            batch_size=batch_size, sampler=MixtureSampler(mix, num_replicas=world, rank=r)
        )
        for k, batch in enumerate(loader):
            read += batch[0].tolist()
            if k + 1 == batches:
                break
        if r == 0:
            state = json.loads(json.dumps(loader.state_dict()))
    return state, read


def _rest(mix: Mixture, world: int, state: dict[str, Any], *, strict: bool = True) -> list[int]:
    read: list[int] = []
    for r in range(world):
        loader = mix.dataloader(batch_size=5, sampler=MixtureSampler(mix, num_replicas=world, rank=r))
        loader.load_state_dict(state, strict=strict)
        read += [i for batch in loader for i in batch[0].tolist()]
    return read


def ids_of(mix: Mixture, order: list[int]) -> list[int]:
    """The sample ids (file names) at the mixture's indices ``order``."""
    return [int(Path(mix.sources[s].samples[j][0]).stem) for s, j in map(mix.source_of, order)]


def test_resume_at_another_world_size_reads_the_rest_of_the_epoch_once(
    sources: dict[str, FolderDataset],
) -> None:
    mix = mixture(sources, {"a": 1, "b": 2, "c": 1}, samples_per_epoch=96, seed=2)
    whole = ids_of(mix, MixtureSampler(mix, num_replicas=1, rank=0).global_order())
    state, before = _state_after(mix, 2, 5)
    after = _rest(mix, 4, state)
    assert len(before) == 40 and len(after) == 56
    assert collections.Counter(before + after) == collections.Counter(whole)


def test_other_weights_at_resume(sources: dict[str, FolderDataset]) -> None:
    """Refused, naming the weights; with strict=False (or reweight_on_resume=True) what was read stays
    read and the rest of the epoch (its length unchanged) follows the new weights exactly."""
    old = mixture(sources, {"a": 1, "b": 1, "c": 0}, samples_per_epoch=80, seed=2)
    state, before = _state_after(old, 1, 6)
    new_weights = {"a": 0, "b": 1, "c": 3}
    with pytest.raises(ConfigError, match=r"weights \{a: 1, b: 1, c: 0\} in the state, \{a: 0, b: 1, c: 3\}"):
        _rest(mixture(sources, new_weights, samples_per_epoch=80, seed=2), 1, state)
    with pytest.warns(UserWarning, match="the rest follows this mixture's"):
        after = _rest(mixture(sources, new_weights, samples_per_epoch=80, seed=2), 1, state, strict=False)
    assert len(before) + len(after) == 80
    source = {v: k for k, v in BASE.items()}
    counts = collections.Counter(source[i // 1000 * 1000] for i in after)
    assert counts == dict(zip("bc", hamilton([1, 3], 56)[:], strict=True))
    assert not set(after) & {i for i in before if i >= 1000}  # b goes on with samples it had not read
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _rest(
            mixture(sources, new_weights, samples_per_epoch=80, seed=2, reweight_on_resume=True), 1, state
        )
    assert again == after


def test_a_state_of_other_sources_is_refused_naming_the_difference(
    sources: dict[str, FolderDataset], tmp_path: Path
) -> None:
    state, _ = _state_after(mixture(sources, {"a": 1, "b": 1, "c": 1}, samples_per_epoch=40), 1, 2)
    other = dict(sources, b=id_folder(tmp_path / "b2", range(1000, 1050)))
    with pytest.raises(ConfigError, match=r"source 'b': its URL is '.*/b' there, '.*/b2' here"):
        _rest(mixture(other, {"a": 1, "b": 1, "c": 1}, samples_per_epoch=40), 1, state, strict=False)
    fewer = {k: v for k, v in sources.items() if k != "c"}
    with pytest.raises(ConfigError, match="source 'c' is in the state, not in this mixture"):
        _rest(mixture(fewer, {"a": 1, "b": 1}, samples_per_epoch=40), 1, state, strict=False)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "weights name 'd', which is not a source"),
        ({"a": 1, "b": 1}, "source 'c' has no weight"),
        ({"a": 1, "b": -1, "c": 1}, "the weight of source 'b' is -1.0"),
        ({"a": 1, "b": float("nan"), "c": 1}, "the weight of source 'b' is nan"),
        ({"a": float("inf"), "b": 1, "c": 1}, "the weight of source 'a' is inf"),
        ({"a": 1, "b": True, "c": 1}, "the weight of source 'b' must be a number"),
        ({"a": 0, "b": 0, "c": 0}, "every weight is 0"),
    ],
)
def test_bad_weights_are_refused_naming_the_source(
    sources: dict[str, FolderDataset], weights: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Mixture(sources, weights)


def test_an_empty_source_is_refused_naming_it(sources: dict[str, FolderDataset], tmp_path: Path) -> None:
    (tmp_path / "empty" / "c0").mkdir(parents=True)
    empty = FolderDataset(tmp_path / "empty", allow_empty=True)
    with pytest.raises(ConfigError, match=r"source 'e' \(file://.*empty\) has no samples"):
        Mixture({**sources, "e": empty}, {"a": 1, "b": 1, "c": 1, "e": 1})
    with pytest.raises(ConfigError, match="samples_per_epoch must be a positive integer"):
        Mixture(sources, {"a": 1, "b": 1, "c": 1}, samples_per_epoch=0)
    with pytest.raises(ConfigError, match="source 'x' must be a FolderDataset or a BlobDataset"):
        Mixture(
            {**sources, "x": torch.utils.data.TensorDataset(torch.zeros(3))}, {"a": 1, "b": 1, "c": 1, "x": 1}
        )

"""Resume at another per-rank batch size (issue 43): the position is counted in samples, the rest of
the interrupted epoch is batched at the new size, every sample of the epoch is read once, and the next
epoch is the uninterrupted run's; with the world size changed too; and what is refused, and how."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from blobdata import ConfigError, ElasticDistributedSampler, FolderDataset, PartitionedSampler
from tests.support.id_folders import id_dataset, sample_id

N = 48
KINDS = ["shuffle", "generator", "sequential", "distributed", "elastic", "partitioned"]


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path / "ds", N)


def _make(ds: FolderDataset, how: str, batch: int, *, workers: int = 0, world: int = 2, rank: int = 0) -> Any:
    kw: dict[str, Any] = {"batch_size": batch, "num_workers": workers}
    if how == "shuffle":
        return ds.dataloader(shuffle=True, **kw)
    if how == "generator":
        return ds.dataloader(shuffle=True, generator=torch.Generator().manual_seed(3), **kw)
    if how == "sequential":
        return ds.dataloader(**kw)
    if how == "partitioned":  # one rank per node
        sampler: Any = PartitionedSampler(ds, num_replicas=world, rank=rank, seed=5, nproc_per_node=1)
    else:
        cls = DistributedSampler if how == "distributed" else ElasticDistributedSampler
        sampler = cls(ds, num_replicas=world, rank=rank, seed=5)
    return ds.dataloader(sampler=sampler, **kw)


def _ids(batch: Any) -> list[int]:
    return [int(x) for x in batch[0].tolist()]


def _epoch(loader: Any, epoch: int, stop_after: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """One epoch's batches of ids (the first ``stop_after`` only), and the state after them."""
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    out: list[list[int]] = []
    for batch in loader:
        out.append(_ids(batch))
        if stop_after is not None and len(out) == stop_after:
            break
    return out, json.loads(json.dumps(loader.state_dict()))


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def _chunks(flat: list[int], size: int) -> list[list[int]]:
    return [flat[k : k + size] for k in range(0, len(flat), size)]


@pytest.mark.parametrize(
    ("workers", "before", "after"), [(0, 4, 2), (0, 4, 5), (0, 4, 8), (2, 4, 5), (2, 8, 3)]
)
@pytest.mark.parametrize("how", KINDS)
def test_another_batch_size_resumes_the_rest_of_the_epoch_once(
    ds: FolderDataset, how: str, workers: int, before: int, after: int
) -> None:
    """Stopped after 3 batches of ``before`` in epoch 1, resumed at ``after``: the rest of the same
    order batched at ``after`` (before: refused, and strict=False duplicated or dropped samples), then
    the next epoch exactly the uninterrupted run's."""
    torch.manual_seed(11)
    full = _make(ds, how, before, workers=workers)
    want = [_flat(_epoch(full, e)[0]) for e in range(3)]
    torch.manual_seed(11)
    first = _make(ds, how, before, workers=workers)
    _epoch(first, 0)
    done, state = _epoch(first, 1, stop_after=3)
    assert state["samples"] == (0 if how in ("elastic", "partitioned") else 3 * before)
    torch.manual_seed(999)  # a fresh process: another global RNG
    resumed = _make(ds, how, after, workers=workers)
    resumed.load_state_dict(state)
    rest, _ = _epoch(resumed, 1)
    assert _flat(done) + _flat(rest) == want[1]  # each sample of the epoch once, in the same order
    assert rest == _chunks(_flat(rest), after)  # batched at the new size
    following, _ = _epoch(resumed, 2)
    assert _flat(following) == want[2] and following == _chunks(want[2], after)


@pytest.mark.parametrize("how", KINDS)
def test_a_chain_of_batch_sizes_within_one_epoch(ds: FolderDataset, how: str) -> None:
    """4, then 5, then 3: the state of a resumed run counts what every run read."""
    torch.manual_seed(2)
    want = _flat(_epoch(_make(ds, how, 4), 0)[0])
    torch.manual_seed(2)
    a, state = _epoch(_make(ds, how, 4), 0, stop_after=2)
    loader = _make(ds, how, 5)
    loader.load_state_dict(state)
    b, state = _epoch(loader, 0, stop_after=1)
    assert state["batches"] == 3
    loader = _make(ds, how, 3)
    loader.load_state_dict(state)
    c, _ = _epoch(loader, 0)
    assert _flat(a) + _flat(b) + _flat(c) == want


def _lockstep(loaders: list[Any], epoch: int, steps: int | None) -> tuple[list[int], list[dict[str, Any]]]:
    """Every rank's loader in lockstep for ``steps`` batches (all of the epoch with None)."""
    seen: list[int] = []
    states = []
    for loader in loaders:
        got, state = _epoch(loader, epoch, stop_after=steps)
        seen += _flat(got)
        states.append(state)
    return seen, states


@pytest.mark.parametrize("how", ["distributed", "elastic", "partitioned"])
def test_the_same_global_batch_on_more_ranks_and_then_fewer(ds: FolderDataset, how: str) -> None:
    """2 x 8 -> 4 x 4 -> 3 x 2 within one epoch: every sample once (the last world size pads its tail
    as DistributedSampler does, repeating what was just read), and the next epoch is whole."""
    seen, states = _lockstep([_make(ds, how, 8, world=2, rank=r) for r in range(2)], 0, 1)
    assert len(seen) == 16 and all({**s, "served": 0} == {**states[0], "served": 0} for s in states)
    four = [_make(ds, how, 4, world=4, rank=r) for r in range(4)]
    for loader in four:
        loader.load_state_dict(states[0])
    more, states = _lockstep(four, 0, 1)
    three = [_make(ds, how, 2, world=3, rank=r) for r in range(3)]
    for loader in three:
        loader.load_state_dict(states[0])
    last, _ = _lockstep(three, 0, None)
    read = seen + more + last
    assert sorted(set(read)) == list(range(N)) and len(read) - N < 3  # padding: at most world - 1
    assert len(seen + more) == len(set(seen + more)) == 32
    nxt, _ = _lockstep(three, 1, None)
    assert sorted(set(nxt)) == list(range(N)) and len(nxt) == 48


def test_len_is_the_whole_epochs_count_or_more_when_the_rest_needs_more(ds: FolderDataset) -> None:
    """len() after loading: a whole epoch's count at the new batch size (Lightning takes it once for
    every epoch), or the batches before plus those left when that is more (a larger batch)."""
    _, state = _epoch(_make(ds, "generator", 4, world=1), 0, stop_after=6)  # 24 of 48 read
    smaller = _make(ds, "generator", 2, world=1)
    smaller.load_state_dict(state)
    assert len(smaller) == 24  # 6 before + 12 left < 24: the whole epoch's count
    assert len(list(smaller)) == 12 and len(smaller) == 24
    larger = _make(ds, "generator", 16, world=1)
    larger.load_state_dict(state)
    assert len(larger) == 6 + 2  # 24 left in batches of 16: more than a whole epoch's 3
    assert [len(b[0]) for b in larger] == [16, 8] and len(larger) == 3


def test_a_loop_that_counts_to_len_before_the_load_is_told_it_cut_the_epoch(ds: FolderDataset) -> None:
    """Lightning takes len() before loading the state and counts the batches done before the stop: at
    a larger global batch it ends the resumed epoch early. The next epoch's iter() says so (before,
    the rest was dropped silently); at a smaller batch the loop runs the rest and the next epoch."""
    _, state = _epoch(_make(ds, "generator", 4, world=1), 0, stop_after=2)  # 8 of 48 read
    for size, cut in ((16, True), (2, False)):
        loader = _make(ds, "generator", size, world=1)
        counted = len(loader)  # as Lightning's fit loop: before the state is loaded (3, then 24)
        loader.load_state_dict(state)
        done = 2
        for _ in loader:
            done += 1
            if done == counted:
                break
        if cut:
            with pytest.raises(ConfigError, match=r"batch size 4 x 1 ranks, here 16 x 1, was left after 3 "
                               r"batches.* with 2 of its batches not read.*no larger than 4"):  # fmt: skip
                iter(loader)
        else:
            assert sorted(_flat(_epoch(loader, 1)[0])) == list(range(N))


def test_strict_false_never_reads_a_sample_twice_or_never(ds: FolderDataset, tmp_path: Path) -> None:
    """Mid-epoch, a state whose order is not this loader's (another seed, number of samples, shuffle)
    is refused even with strict=False; at an epoch's end it is loaded with a warning; another dataset
    URL over the same listing resumes exactly, with a warning."""
    _, state = _epoch(_make(ds, "distributed", 4), 0, stop_after=2)
    other_seed = ds.dataloader(batch_size=4, sampler=DistributedSampler(ds, 2, 0, seed=6))
    with pytest.raises(ConfigError, match=r"sampler seed: the state's is 5, this loader's 6.*even with"):
        other_seed.load_state_dict(state, strict=False)
    fewer = id_dataset(tmp_path / "fewer", N - 8)
    with pytest.raises(ConfigError, match="number of samples: the state's is 48, this loader's 40"):
        _make(fewer, "distributed", 4).load_state_dict(state, strict=False)
    no_shuffle = ds.dataloader(batch_size=4, sampler=DistributedSampler(ds, 2, 0, seed=5, shuffle=False))
    with pytest.raises(ConfigError, match="sampler shuffle"):
        no_shuffle.load_state_dict(state, strict=False)
    _, ended = _epoch(_make(ds, "distributed", 4), 0)
    with pytest.warns(UserWarning, match="sampler seed: the state's is 5, this loader's 6"):
        other_seed.load_state_dict(ended, strict=False)
    rank1 = ds.dataloader(batch_size=4, sampler=DistributedSampler(ds, 2, 1, seed=6))
    assert sorted(_flat(_epoch(other_seed, 1)[0]) + _flat(_epoch(rank1, 1)[0])) == list(range(N))  # whole
    # The same files elsewhere: the same listing, another URL.
    copy = FolderDataset(shutil.copytree(ds.root, tmp_path / "copy"), loader=sample_id)
    want = _flat(_epoch(_make(ds, "generator", 4), 0)[0])
    done, gstate = _epoch(_make(ds, "generator", 4), 0, stop_after=3)
    moved = _make(copy, "generator", 8)
    with pytest.raises(ConfigError, match="dataset URL"):
        moved.load_state_dict(gstate)
    with pytest.warns(UserWarning, match="dataset URL"):
        moved.load_state_dict(gstate, strict=False)
    assert _flat(done) + _flat(_epoch(moved, 0)[0]) == want


def test_a_distributed_state_on_one_device_without_a_distributed_sampler_says_what_to_do(
    ds: FolderDataset,
) -> None:
    """Saved under DDP (a DistributedSampler, as Lightning puts in), resumed on one device where the
    loader has shuffle=True's sampler: refused naming both, and Lightning's way to keep its sampler."""
    _, state = _epoch(_make(ds, "distributed", 8), 0, stop_after=1)
    with pytest.raises(ConfigError, match=r"sampler kind: the state's is 'distributed', this loader's "
                       r"'generator'.*strategy=\"ddp\"\) keeps it"):  # fmt: skip
        _make(ds, "shuffle", 16).load_state_dict(state)
    one = _make(ds, "distributed", 16, world=1)  # Trainer(strategy="ddp") on one device: it resumes
    one.load_state_dict(state)
    rest = _flat(_epoch(one, 0)[0])
    assert len(rest) == N - 2 * 8 and len(set(rest)) == len(rest)


def test_a_batch_sampler_of_its_own_resumes_at_its_own_size_only(ds: FolderDataset) -> None:
    """blobdata cannot batch again what a batch_sampler of another kind batches: the same size skips
    its batches as before; another size is refused, saying what to pass instead."""

    class Own(BatchSampler):
        pass

    def make(size: int) -> Any:
        return ds.dataloader(batch_sampler=Own(SequentialSampler(ds), size, False))

    want = _flat(_epoch(make(4), 0)[0])
    _, state = _epoch(make(4), 0, stop_after=2)
    same = make(4)
    same.load_state_dict(state)
    assert _flat(_epoch(same, 0)[0]) == want[8:]
    refused = r"batch_size=4 at world size 1; this loader has 8 at 1.*batch_sampler \(Own\).*pass batch_size="
    with pytest.raises(ConfigError, match=refused):
        make(8).load_state_dict(state)


def test_a_state_of_version_2_resumes_at_another_batch_size(ds: FolderDataset) -> None:
    """blobdata 0.2.0's states count whole batches of their batch size: that is the position."""
    want = _flat(_epoch(_make(ds, "generator", 4, world=1), 0)[0])
    done, state = _epoch(_make(ds, "generator", 4, world=1), 0, stop_after=5)
    old = {k: v for k, v in state.items() if k != "samples"}
    old["version"] = 2
    resumed = _make(ds, "generator", 6, world=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(old)
    assert _flat(done) + _flat(_epoch(resumed, 0)[0]) == want

"""Loader state: resuming reproduces the interrupted epoch's remaining batches exactly, the state is
small JSON, and an elastic sampler resumes at another world size with each remaining sample once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from blobdata import (
    BlobdataError,
    ConfigError,
    ElasticDistributedSampler,
    FolderDataset,
    ManifestError,
    PartitionedSampler,
)
from tests.support.id_folders import id_dataset, sample_id


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path, 48)


def _ids_of(batch: Any) -> list[int]:
    return [int(x) for x in batch[0].tolist()]


def _make(ds: FolderDataset, how: str, workers: int, world: int = 1, rank: int = 0) -> Any:
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": workers}
    if how == "shuffle":
        return ds.dataloader(shuffle=True, **kw)
    if how == "generator":
        return ds.dataloader(shuffle=True, generator=torch.Generator().manual_seed(3), **kw)
    if how == "partitioned":  # one rank per node
        sampler = PartitionedSampler(ds, num_replicas=world, rank=rank, seed=5, nproc_per_node=1)
        return ds.dataloader(sampler=sampler, **kw)
    cls = DistributedSampler if how == "distributed" else ElasticDistributedSampler
    return ds.dataloader(sampler=cls(ds, num_replicas=world, rank=rank, seed=5), **kw)


def _epochs(loader: Any, epochs: range, stop_after: int | None = None) -> tuple[list[list[int]], Any]:
    out: list[list[int]] = []
    for epoch in epochs:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for k, batch in enumerate(loader):
            out.append(_ids_of(batch))
            if stop_after is not None and epoch == epochs[-1] and k + 1 == stop_after:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["shuffle", "generator", "distributed", "elastic", "partitioned"])
def test_resume_mid_epoch_gives_the_uninterrupted_batches(ds: FolderDataset, how: str, workers: int) -> None:
    torch.manual_seed(11)
    full, _ = _epochs(_make(ds, how, workers, world=2), range(3))
    torch.manual_seed(11)
    first, state = _epochs(_make(ds, how, workers, world=2), range(2), stop_after=3)
    assert state["batches"] == 3 and state["epoch"] == 1 and not state["complete"]
    assert len(json.dumps(state)) < 8000  # no per-sample list
    torch.manual_seed(999)  # a fresh process: another global RNG
    resumed = _make(ds, how, workers, world=2)
    resumed.load_state_dict(state)
    rest, _ = _epochs(resumed, range(1, 3))
    assert first + rest == full


def test_resume_after_a_complete_epoch_starts_the_next(ds: FolderDataset) -> None:
    full, _ = _epochs(_make(ds, "generator", 0), range(2))
    first, state = _epochs(_make(ds, "generator", 0), range(1))
    assert state["complete"]
    resumed = _make(ds, "generator", 0)
    resumed.load_state_dict(state)
    rest, _ = _epochs(resumed, range(1, 2))
    assert first + rest == full


@pytest.mark.parametrize("how", ["elastic", "distributed"])
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_elastic_resume_at_another_world_size_sees_the_rest_once(
    ds: FolderDataset, before: int, after: int, how: str
) -> None:
    """ElasticDistributedSampler, and a plain DistributedSampler (before: refused mid-epoch), whose
    interrupted epoch goes on through its elastic equivalent."""
    loaders = [_make(ds, how, 0, world=before, rank=r) for r in range(before)]
    seen: list[int] = []
    states = []
    for loader in loaders:  # in lockstep: every rank 3 batches
        loader.sampler.set_epoch(0)
        it = iter(loader)
        for _ in range(3):
            seen += _ids_of(next(it))
        states.append(loader.state_dict())
    # The position is rank-independent; the digest of the indices served is each rank's own.
    assert all({**s, "served": None} == {**states[0], "served": None} for s in states)
    rest: list[int] = []
    for r in range(after):
        loader = _make(ds, how, 0, world=after, rank=r)
        loader.load_state_dict(states[0])
        loader.sampler.set_epoch(0)
        rest += [i for b in loader for i in _ids_of(b)]
    assert len(seen) == 3 * 4 * before
    assert sorted(seen + rest) == list(range(48))


def test_a_distributed_sampler_subclass_at_another_world_size_is_refused_naming_what_to_do(
    ds: FolderDataset,
) -> None:
    """Its order may not be DistributedSampler's: the rest cannot be dealt to other ranks for it."""

    class Mine(DistributedSampler):  # type: ignore[type-arg]
        pass

    _, state = _epochs(ds.dataloader(batch_size=4, sampler=Mine(ds, 4, 0, seed=5)), range(1), stop_after=1)
    refused = r"world size 4, this is 2: .* a Mine may not have\. Resume it at world size 4, or use torch's"
    with pytest.raises(ConfigError, match=refused):
        ds.dataloader(batch_size=4, sampler=Mine(ds, 2, 0, seed=5)).load_state_dict(state)
    again = ds.dataloader(batch_size=4, sampler=Mine(ds, 4, 1, seed=5))  # the same world size: exact
    again.load_state_dict(state)
    assert len(list(again)) == 2


def test_elastic_sampler_is_distributed_samplers_order(ds: FolderDataset) -> None:
    for r in range(3):
        a, b = DistributedSampler(ds, 3, r, seed=4), ElasticDistributedSampler(ds, 3, r, seed=4)
        a.set_epoch(2)
        b.set_epoch(2)
        assert list(a) == list(b) and len(a) == len(b)


def test_bad_state_is_refused(ds: FolderDataset) -> None:
    loader = _make(ds, "shuffle", 0)
    with pytest.raises(ConfigError, match="version"):
        loader.load_state_dict({"version": 99})
    with pytest.raises(ConfigError, match="sampler"):
        loader.load_state_dict({**_make(ds, "distributed", 0).state_dict()})


def test_a_rank_waiting_for_rank_0s_listing_gives_up_with_a_clear_error(
    ds: FolderDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "BLOBDATA_SHARED_TIMEOUT": "0.3"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("BLOBDATA_SHARED_DIR", str(tmp_path / "shared"))
    with pytest.raises(
        ManifestError, match=r"waited 0s for rank 0's listing of file://.*BLOBDATA_SHARED_DIR"
    ):
        FolderDataset(ds.root, loader=sample_id)


def test_rank_0s_listing_reaches_the_other_ranks_over_the_shared_file(
    ds: FolderDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("BLOBDATA_SHARED_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("RANK", "0")
    first = FolderDataset(ds.root, loader=sample_id)
    (Path(ds.root) / "c0" / "new.png").write_bytes(b"x")  # the folder changes
    monkeypatch.setenv("RANK", "1")
    second = FolderDataset(ds.root, loader=sample_id)  # gets rank 0's table, not a new listing
    assert second.manifest.to_bytes() == first.manifest.to_bytes() and len(second) == 48
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(BlobdataError):
        FolderDataset(str(tmp_path / "missing"), loader=sample_id)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ManifestError, match="rank 0 could not list"):
        FolderDataset(str(tmp_path / "missing"), loader=sample_id)


def test_out_of_order_loaders_have_no_resumable_state(ds: FolderDataset) -> None:
    loader = ds.dataloader(batch_size=4, num_workers=2, in_order=False)
    with pytest.raises(ConfigError, match="in_order=True"):
        loader.state_dict()


# -- issue 22: what torchdata's StatefulDataLoader protocol promises, and Lightning relies on ----------


@pytest.mark.parametrize("how", ["shuffle", "generator", "distributed", "elastic", "partitioned"])
def test_len_stays_the_whole_epoch_after_a_resume(ds: FolderDataset, how: str) -> None:
    """Lightning takes the epoch's length from len(loader) and subtracts the batches it counted: a
    resumed loader must keep the whole epoch's length (StatefulDataLoader does) and yield the rest."""
    torch.manual_seed(5)
    full, _ = _epochs(_make(ds, how, 0, world=2), range(2))
    torch.manual_seed(5)
    first, state = _epochs(_make(ds, how, 0, world=2), range(1), stop_after=2)
    resumed = _make(ds, how, 0, world=2)
    whole = len(resumed)  # 48 samples in batches of 4; a rank of 2 reads 24
    assert whole == (12 if how in ("shuffle", "generator") else 6)
    resumed.load_state_dict(state)
    assert len(resumed) == whole  # before: 4 with the elastic sampler
    if hasattr(resumed.sampler, "set_epoch"):
        resumed.sampler.set_epoch(0)
    rest = [_ids_of(b) for b in resumed]
    assert len(resumed) == whole and len(rest) == whole - 2
    if hasattr(resumed.sampler, "set_epoch"):
        resumed.sampler.set_epoch(1)
    second = [_ids_of(b) for b in resumed]
    assert len(second) == whole == len(resumed)  # the next epoch is whole
    assert first + rest + second == full


def test_len_after_a_resume_at_another_world_size_is_the_whole_epochs_here(ds: FolderDataset) -> None:
    """At another world size, len() is a whole epoch's count here (Lightning takes it once, for every
    epoch: before, it was the batches before the stop plus those left, and the next epoch was cut to
    that); the resumed epoch itself yields the rest, then ends."""
    loader = _make(ds, "elastic", 0, world=4, rank=0)
    loader.sampler.set_epoch(0)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()  # 2 batches x 4 x 4 ranks = 32 of 48 consumed
    again = _make(ds, "elastic", 0, world=2, rank=1)
    whole = len(again)
    again.load_state_dict(state)
    assert len(again) == whole == 6
    rest = list(again)  # 16 left, 8 for this rank: 2 batches
    assert len(rest) == 2 and len(again) == whole
    again.sampler.set_epoch(1)
    assert len(list(again)) == whole == len(again)


def test_state_right_after_loading_is_the_loaded_position(ds: FolderDataset) -> None:
    """A checkpoint taken after load_state_dict and before the first batch (at train start, or on an
    early exception) keeps the position; before, it said {batches: 0, complete: true}."""
    full, _ = _epochs(_make(ds, "generator", 0), range(1))
    _, state = _epochs(_make(ds, "generator", 0), range(1), stop_after=3)
    loader = _make(ds, "generator", 0)
    loader.load_state_dict(state)
    again = json.loads(json.dumps(loader.state_dict()))
    assert again == state
    it = iter(loader)  # made, no batch yet
    assert loader.state_dict() == state
    assert _ids_of(next(it)) == full[3]
    final = _make(ds, "generator", 0)
    final.load_state_dict(again)
    assert [_ids_of(b) for b in final] == full[3:]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_between_iter_and_the_first_batch_replays_that_epoch(ds: FolderDataset, workers: int) -> None:
    """With a generator shared by the sampler and the loader, DataLoader draws its base seed from it
    at iter(); a state taken then must replay the epoch that iterator was going to yield."""
    loader = _make(ds, "generator", workers)
    _epochs(loader, range(1))  # one whole epoch first
    it = iter(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    running = [_ids_of(b) for b in it]
    resumed = _make(ds, "generator", workers)
    resumed.load_state_dict(state)
    assert [_ids_of(b) for b in resumed] == running


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13
def test_a_stateful_dataloader_checkpoint_is_refused_clearly(ds: FolderDataset) -> None:
    """The README says the formats do not interoperate: a StatefulDataLoader state is refused with a
    ConfigError, not misread; switching at an epoch boundary gives the same next epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    theirs = StatefulDataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    it = iter(theirs)
    next(it)
    with pytest.raises(ConfigError, match="not a blobdata loader state"):
        _make(ds, "generator", 0).load_state_dict(theirs.state_dict())
    ours = _make(ds, "generator", 0)  # same seed: the same epoch as a plain DataLoader's
    gen = torch.Generator().manual_seed(3)
    plain = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, generator=gen)
    assert [_ids_of(b) for b in ours] == [_ids_of(b) for b in plain]

"""The loader from ds.dataloader() is a DataLoader: the same batches for the same seeded generator, and
the attributes tools read (batch_size, sampler, drop_last, len) say what was asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blobdata import BlobLoader, ConfigError, FolderDataset
from tests.support.id_folders import id_dataset


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    return id_dataset(tmp_path, 37)


def _batches(loader: Any) -> list[list[int]]:
    return [b[0].tolist() for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_as_a_plain_dataloader(ds: FolderDataset, workers: int) -> None:
    kw: dict[str, Any] = {"batch_size": 5, "shuffle": True, "num_workers": workers, "drop_last": True}
    plain = torch.utils.data.DataLoader(ds, generator=torch.Generator().manual_seed(7), **kw)
    ours = ds.dataloader(generator=torch.Generator().manual_seed(7), **kw)
    for _epoch in range(2):  # the generator advances per epoch in both
        assert _batches(ours) == _batches(plain)


def test_attributes_say_what_was_asked_for(ds: FolderDataset) -> None:
    loader = ds.dataloader(batch_size=5, shuffle=True, drop_last=True)
    assert isinstance(loader, torch.utils.data.DataLoader) and isinstance(loader, BlobLoader)
    assert loader.batch_size == 5 and loader.drop_last is True
    assert isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert len(loader) == 37 // 5
    seq = ds.dataloader(batch_size=4)
    assert isinstance(seq.sampler, torch.utils.data.SequentialSampler) and len(seq) == 10
    assert seq.drop_last is False


def test_user_batch_sampler_and_rebuild_from_arguments(ds: FolderDataset) -> None:
    bs = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 6, False)
    loader = BlobLoader(ds, batch_sampler=bs)
    assert loader.batch_size == 6 and len(loader) == 7
    assert _batches(loader)[0] == [int(Path(u).stem) for u, _ in ds.samples[:6]]
    # Lightning-style rebuild: the constructor's own arguments make an equivalent loader.
    again = type(loader)(ds, batch_size=loader.batch_size, sampler=loader.sampler, drop_last=loader.drop_last)
    assert _batches(again) == _batches(loader)


def test_dataloader_argument_errors(ds: FolderDataset) -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        ds.dataloader(batch_size=4, shuffle=True, sampler=torch.utils.data.SequentialSampler(ds))
    with pytest.raises(ConfigError, match="batch_size=None"):
        ds.dataloader(batch_size=None)
    with pytest.raises(ConfigError, match="FolderDataset"):
        BlobLoader(list(range(3)))  # type: ignore[arg-type]


# -- issue 22: tools that rebuild a loader (Lightning's _update_dataloader) -----------------------------


def _lightning_rebuild(make: Any, sampler: Any, mode: str) -> Any:
    """What Lightning does to a loader its hooks return: record the constructor's arguments while
    the hook runs, then re-make the loader with its own sampler."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"), _replace_dunder_methods(
        torch.utils.data.BatchSampler
    ):
        loader = make()
    stage = RunningStage.PREDICTING if mode == "predict" else RunningStage.TRAINING
    return _update_dataloader(loader, sampler, mode=stage)


@pytest.mark.parametrize("mode", ["fit", "predict"])
@pytest.mark.parametrize("how", ["ds.dataloader", "BlobLoader keywords", "attributes"])
def test_lightning_rebuilds_it_and_it_still_fetches_ahead(ds: FolderDataset, how: str, mode: str) -> None:
    """Before: ds.dataloader() passed batch_size and shuffle positionally (Lightning: "more than one
    __init__ argument"), a keyword-built loader exposed its PlanningBatchSampler, which Lightning re-made
    as PlanningBatchSampler(sampler, 5, False) ('bool' object has no attribute 'begin'), and predict
    failed on PlanningBatchSampler(..., batch_size=...)."""
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)

    def make() -> Any:
        if how == "ds.dataloader":
            return ds.dataloader(batch_size=5, shuffle=True)
        return BlobLoader(ds, batch_size=5, shuffle=True)

    if how == "attributes":  # made outside the hook: rebuilt from its attributes
        pytest.importorskip("lightning")
        from lightning.pytorch.trainer.states import RunningStage
        from lightning.pytorch.utilities.data import _update_dataloader

        stage = RunningStage.PREDICTING if mode == "predict" else RunningStage.TRAINING
        rebuilt = _update_dataloader(make(), sampler, mode=stage)
    else:
        rebuilt = _lightning_rebuild(make, sampler, mode)
    assert isinstance(rebuilt, BlobLoader)
    got = _batches(rebuilt)
    stats = rebuilt.stats()
    plain = torch.utils.data.DataLoader(ds, batch_size=5, sampler=sampler)
    assert got == _batches(plain) and len(rebuilt) == len(plain) == 4
    assert stats.samples == 19 and stats.samples_staged > 0  # 19 of 37 on rank 1; the look-ahead works
    if mode == "predict":  # Lightning's index-recording batch sampler saw every batch
        assert rebuilt.batch_sampler.seen_batch_indices == [list(b) for b in torch.utils.data.BatchSampler(
            sampler, 5, False)]  # fmt: skip


def test_rebuilt_from_attributes_workers_read_the_new_loaders_plan(ds: FolderDataset) -> None:
    """The worker_init_fn attribute is blobdata's wrapper; a loader re-made from it must not point its
    workers at the old loader's plan (they would then fetch nothing ahead)."""
    loader = ds.dataloader(batch_size=4, num_workers=1, shuffle=True)
    again = BlobLoader(ds, batch_size=4, num_workers=1, sampler=loader.sampler,
                       worker_init_fn=loader.worker_init_fn)  # fmt: skip
    assert again.worker_init_fn.user is None  # type: ignore[union-attr]
    assert sum(len(b[0]) for b in again) == 37
    assert again.stats().samples_staged > 0

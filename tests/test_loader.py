"""The loader from ds.dataloader() is a DataLoader: the same batches for the same seeded generator, and
the attributes tools read (batch_size, sampler, drop_last, len) say what was asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blobdata import BlobLoader, ConfigError, FolderDataset


def _ids(f: Any) -> int:
    return int(Path(f.name).stem)


@pytest.fixture
def ds(tmp_path: Path) -> FolderDataset:
    for i in range(37):
        d = tmp_path / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"{i}.png").write_bytes(b"x")
    return FolderDataset(tmp_path, loader=_ids, lookahead=16)


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

"""A mixture read by others' loaders and paths (issue 41), on local folders: torchdata's
StatefulDataLoader gives the same batches and resumes them, the device path decodes every source's
images, ``with_source`` composes with default_collate for tuple and dict samples, a source's bad sample
is skipped and reported, len() stays the whole epoch's after a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from blobdata import BlobDataset, FolderDataset, Mixture, MixtureSampler, gpu
from blobdata.testing import synthetic_jpeg
from tests.support.id_folders import sample_id


def id_folder(root: Path, ids: range, *, jpeg: bool = False) -> Path:
    rng = np.random.default_rng(len(ids))
    for i in ids:
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.jpg").write_bytes(synthetic_jpeg(rng, min_side=20, max_side=40) if jpeg else b"x")
    return root


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mixlocal")
    return {
        "a": id_folder(base / "a", range(0, 20), jpeg=True),
        "b": id_folder(base / "b", range(100, 112), jpeg=True),
    }


def ids_mixture(roots: dict[str, Path], **kw: Any) -> Mixture:
    return Mixture({k: FolderDataset(v, loader=sample_id) for k, v in roots.items()}, {"a": 1, "b": 1}, **kw)


def _ids(batches: Any) -> list[list[int]]:
    return [b[0].tolist() for b in batches]


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata 0.11 on torch 2.13
def test_a_stateful_dataloader_reads_the_mixture_as_blobdata_does_and_resumes(roots: dict[str, Path]) -> None:
    """torchdata's StatefulDataLoader over the mixture and its sampler: the batches of mix.dataloader();
    stopped after 3 batches, its own state resumes the rest."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    mix = ids_mixture(roots, seed=4)
    ours = _ids(mix.dataloader(batch_size=4, sampler=MixtureSampler(mix)))
    theirs = StatefulDataLoader(mix, batch_size=4, sampler=MixtureSampler(mix))
    assert _ids(theirs) == ours and len(ours) == 8
    first = StatefulDataLoader(mix, batch_size=4, sampler=MixtureSampler(mix))
    it = iter(first)
    head = [next(it)[0].tolist() for _ in range(3)]
    state = first.state_dict()
    again = StatefulDataLoader(mix, batch_size=4, sampler=MixtureSampler(mix))
    again.load_state_dict(state)
    assert head + _ids(again) == ours


def test_len_stays_the_whole_epoch_after_a_resume(roots: dict[str, Path]) -> None:
    """As for one dataset (Lightning counts batches against len()): the whole epoch's count."""
    mix = ids_mixture(roots)
    loader = mix.dataloader(batch_size=4, num_workers=2)
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = ids_mixture(roots).dataloader(batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    assert len(resumed) == len(loader) == 8
    assert head + _ids(resumed) == _ids(ids_mixture(roots).dataloader(batch_size=4))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_path_decodes_every_sources_images(roots: dict[str, Path], workers: int) -> None:
    """device="cpu" (the GPU path run on the CPU): images of both sources, one tensor a batch; with
    with_source the targets are (target, source) pairs, which default_collate makes two tensors."""
    mix = Mixture({k: FolderDataset(v) for k, v in roots.items()}, {"a": 3, "b": 1}, with_source=True)
    loader = mix.dataloader(
        batch_size=8, num_workers=workers, device="cpu", gpu_transform=gpu.TrainTransform(8)
    )
    sources: list[int] = []
    for images, (targets, source) in loader:
        assert images.shape[1:] == (3, 8, 8) and images.shape[0] == len(targets) == len(source)
        sources += source.tolist()
    assert len(sources) == 32 and sources.count(0) == 24 and sources.count(1) == 8


def test_with_source_on_dict_samples(tmp_path: Path) -> None:
    """BlobDataset sources (dict samples) get "source"; default_collate gives the batch's as a tensor."""
    for name, n in (("x", 6), ("y", 3)):
        for i in range(n):
            (tmp_path / name).mkdir(exist_ok=True)
            (tmp_path / name / f"s{i}.txt").write_text(f"{name}{i}")
    mix = Mixture({n: BlobDataset(tmp_path / n) for n in "xy"}, {"x": 1, "y": 2}, with_source=True)
    batches = list(mix.dataloader(batch_size=3))
    assert len(batches) == 3
    for batch in batches:
        assert [int(s) for s in batch["source"]] == [mix.names.index(t[0]) for t in batch["txt"]]
        assert sorted(batch["source"].tolist()) == [0, 1, 1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sources_bad_sample_is_skipped_and_reported(tmp_path: Path, workers: int) -> None:
    good = id_folder(tmp_path / "good", range(8), jpeg=True)
    bad = id_folder(tmp_path / "bad", range(50, 54), jpeg=True)
    (bad / "c0" / "52.jpg").write_bytes(b"not a jpeg")
    sources = {"good": FolderDataset(good), "bad": FolderDataset(bad, on_error="skip")}
    mix = Mixture(sources, {"good": 1, "bad": 1})
    loader = mix.dataloader(batch_size=4, num_workers=workers, collate_fn=lambda batch: batch)
    got = sum(len(batch) for batch in loader)
    assert got == 12 - 2  # the bad sample is read twice an epoch (4 samples, 6 reads)
    assert [url.rsplit("/", 1)[-1] for url, _ in mix.errors] == ["52.jpg", "52.jpg"]
    assert loader.stats().sources["bad"].errors_skipped == 2


def test_a_source_that_raises_names_its_url(tmp_path: Path) -> None:
    good = id_folder(tmp_path / "good", range(4), jpeg=True)
    bad = id_folder(tmp_path / "bad", range(50, 52), jpeg=True)
    (bad / "c1" / "51.jpg").write_bytes(b"not a jpeg")
    mix = Mixture({"good": FolderDataset(good), "bad": FolderDataset(bad)}, {"good": 1, "bad": 1})
    with pytest.raises(Exception, match=r"bad/c1/51\.jpg"):
        list(mix.dataloader(batch_size=2))
    assert torch.utils.data.get_worker_info() is None

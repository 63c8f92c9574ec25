"""Augmentation draws keyed by (loader seed, epoch, sample URL): the same pixels whatever the number of
workers, the worker that served a sample, or a resume in between (CPU path)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import blobdata
from blobdata import ConfigError, FolderDataset
from blobdata.testing import synthetic_jpeg
from blobdata.transforms import RandomResizedCrop

BATCH = 4
SAMPLES = 48  # 12 batches


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(3)
    for i in range(SAMPLES):
        d = root / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(synthetic_jpeg(rng, min_side=40, max_side=90))
    return root


def _loader(folder: Path, workers: int, **kw: Any) -> Any:
    ds = FolderDataset(folder, transform=RandomResizedCrop(16), lookahead=8)
    return ds.dataloader(
        batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=workers > 0, **kw
    )


def _run(loader: Any, epochs: int, stop_after: int | None = None) -> tuple[list[Any], Any]:
    out: list[Any] = []
    for epoch in range(epochs):
        for k, (images, labels) in enumerate(loader):
            out.append((images.clone(), labels.clone()))
            if stop_after is not None and epoch == epochs - 1 and k + 1 == stop_after:
                return out, json.loads(json.dumps(loader.state_dict()))
    return out, None


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.timeout(300)
def test_resumed_run_gives_the_uninterrupted_pixels_and_labels(folder: Path) -> None:
    torch.manual_seed(1)
    full, _ = _run(_loader(folder, 2), epochs=2)
    assert len(full) == 24
    torch.manual_seed(1)
    first, state = _run(_loader(folder, 2), epochs=1, stop_after=5)
    torch.manual_seed(12345)  # a fresh process: another global RNG, another worker seed
    resumed = _loader(folder, 2)
    resumed.load_state_dict(state)
    rest, _ = _run(resumed, epochs=2)  # the 7 batches left of epoch 1, then epoch 2
    assert len(first) == 5 and len(rest) == 19
    assert _same(first + rest, full)
    # Not trivially so: epoch 2 draws other crops than epoch 1 for the same samples.
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(full[:12], full[12:], strict=True))


@pytest.mark.timeout(300)
def test_pixels_do_not_depend_on_the_number_of_workers(folder: Path) -> None:
    g = 7
    one, _ = _run(_loader(folder, 1, generator=torch.Generator().manual_seed(g)), epochs=1)
    two, _ = _run(_loader(folder, 2, generator=torch.Generator().manual_seed(g)), epochs=1)
    none, _ = _run(_loader(folder, 0, generator=torch.Generator().manual_seed(g)), epochs=1)
    assert _same(one, two) and _same(one, none)
    other, _ = _run(_loader(folder, 0, generator=torch.Generator().manual_seed(g + 1)), epochs=1)
    assert not _same(one, other)


def test_cpu_crop_draws_the_gpu_paths_boxes() -> None:
    from blobdata._sampling import enter_sample, epoch_seed, leave_sample, sample_key
    from blobdata.gpu import TrainTransform

    seed = epoch_seed(5, 2)
    urls = [f"s3://b/c/{i}.jpg" for i in range(600)]
    rng = np.random.default_rng(0)
    sizes = np.concatenate([rng.integers(20, 900, (500, 2)), rng.integers(1, 40, (100, 2))])  # fallbacks too
    gpu_boxes, gpu_flips = TrainTransform(32).draw_keyed(
        sizes, np.array([sample_key(u) for u in urls], dtype=np.uint64), seed
    )
    crop = RandomResizedCrop(32)
    seconds = []
    for (h, w), url, box, flip in zip(sizes.tolist(), urls, gpu_boxes, gpu_flips, strict=True):
        token = enter_sample(seed, url)
        try:
            assert crop._draw(w, h) == (box, flip)
            seconds.append(crop._draw(w, h))  # a second view of the same sample draws again
        finally:
            leave_sample(token)
    assert sum(a != (b, f) for a, b, f in zip(seconds, gpu_boxes, gpu_flips, strict=True)) > 450


def _user_transform(img: Any) -> tuple[float, int]:
    g = blobdata.sample_rng()
    t = blobdata.sample_rng("torch")
    return float(g.uniform()), int(torch.randint(0, 1 << 30, (1,), generator=t).item())


@pytest.mark.timeout(300)
def test_sample_rng_is_keyed_for_user_transforms(folder: Path) -> None:
    def draws(workers: int, seed: int) -> dict[str, Any]:
        ds = FolderDataset(folder, transform=_user_transform, lookahead=8)
        loader = ds.dataloader(
            batch_size=BATCH, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(seed)
        )
        out: dict[str, Any] = {}
        for epoch in range(2):
            for (u, t), _ in loader:
                for k, (a, b) in enumerate(zip(u.tolist(), t.tolist(), strict=True)):
                    out.setdefault(str(epoch), []).append((a, b, k))
        return {e: sorted(v) for e, v in out.items()}

    base = draws(0, 3)
    assert base == draws(2, 3)
    assert base["0"] != base["1"] and base != draws(0, 4)
    # Two calls within one sample continue one generator: independent values, not a repeat.
    assert len({a for a, _, _ in base["0"]}) == SAMPLES


def test_sample_rng_outside_a_transform_is_a_clear_error(folder: Path) -> None:
    with pytest.raises(ConfigError, match="no sample is being transformed"):
        blobdata.sample_rng()
    ds = FolderDataset(folder, transform=_user_transform, lookahead=0)
    torch.manual_seed(0)
    a = ds[0][0]
    torch.manual_seed(0)
    assert ds[0][0] == a  # without a loader: seeded from torch's global RNG
    with pytest.raises(ConfigError, match="'numpy' or 'torch'"):
        FolderDataset(folder, transform=lambda img: blobdata.sample_rng("jax"))[0]  # type: ignore[arg-type]

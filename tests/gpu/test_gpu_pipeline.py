"""The loader's device path on the CPU (issue 25, items 7-10): augmentation reproducible from the loader's
seed, workers gone after an error, decode and transform overlapped, CPU fallbacks in the workers, and
the batch's bytes crossing from the workers without extra copies."""

from __future__ import annotations

import gc
import io
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from PIL import Image

from blobdata import FolderDataset, gpu
from blobdata.gpu import _decoders
from blobdata.gpu._pipeline import RawBatch, collate_raw

pytestmark = pytest.mark.timeout(120)


def _jpeg(seed: int, h: int, w: int, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _folder(root: Path, n: int) -> Path:
    for i in range(n):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i:03d}.jpg").write_bytes(_jpeg(i, 30 + 3 * i, 50 - i))
    return root


def _transform() -> gpu.TrainTransform:
    return gpu.TrainTransform(16, channels_last=False)  # no generator of its own


# -- 7. the loader's seed decides the augmentation ------------------------------------------------------
def _run(
    root: Path, *, global_seed: int, loop_draws: int, workers: int, epochs: int = 2
) -> list[torch.Tensor]:
    torch.manual_seed(global_seed)
    loader = FolderDataset(root).dataloader(
        batch_size=4, shuffle=True, num_workers=workers, device="cpu", gpu_transform=_transform(),
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    out = []
    for _ in range(epochs):
        for images, _targets in loader:
            out.append(images)
            torch.rand(loop_draws)  # what a training loop draws: dropout, mixup...
    return out


def test_the_same_loader_seed_gives_the_same_batches(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 12)
    a = _run(root, global_seed=0, loop_draws=1, workers=0)
    b = _run(root, global_seed=1, loop_draws=7, workers=2)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    # Each epoch draws anew (the same sample is not cropped alike every epoch).
    assert not all(torch.equal(x, y) for x, y in zip(a[:3], a[3:], strict=True))


def test_a_resumed_epoch_gives_the_rest_of_the_same_batches(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", 12)
    ds = FolderDataset(root)

    def loader() -> Any:
        return ds.dataloader(batch_size=3, shuffle=True, device="cpu", gpu_transform=_transform(),
                             generator=torch.Generator().manual_seed(3))  # fmt: skip

    full = [images for images, _ in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)[0] for _ in range(2)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    rest = [images for images, _ in again]
    assert len(head) + len(rest) == len(full)
    for x, y in zip(head + rest, full, strict=True):
        assert torch.equal(x, y)


def test_keyed_draws_follow_torchvisions_rule() -> None:
    t = gpu.TrainTransform(32, scale=(0.25, 0.5), ratio=(0.5, 2.0), flip=0.3)
    n = 4000
    sizes = np.stack([np.full(n, 300), np.arange(n) % 400 + 200], axis=1)
    keys = np.arange(n) * 7919
    boxes, flips = t.draw_keyed(sizes, keys, seed=11)
    assert (boxes, flips) == t.draw_keyed(sizes, keys, seed=11)
    assert (boxes, flips) != t.draw_keyed(sizes, keys, seed=12)
    b = np.array(boxes, dtype=np.float64)
    top, left, h, w = b.T
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= sizes[:, 0]).all() and (left + w <= sizes[:, 1]).all()
    area = h * w / (sizes[:, 0] * sizes[:, 1])
    assert area.min() > 0.24 and area.max() < 0.51  # rounding aside, within scale
    assert (w / h).min() > 0.49 and (w / h).max() < 2.05
    assert abs(np.mean(flips) - 0.3) < 0.03
    # An image too narrow for any allowed box gets torchvision's fallback: the central crop of ratio 0.5.
    (box,), _ = t.draw_keyed(np.array([[1000, 10]]), np.array([5]), seed=1)
    assert box == ((1000 - 20) // 2, 0, 20, 10)


# -- 8. an error ends the epoch's workers at once -------------------------------------------------------
class _FailsOnce:
    def __init__(self) -> None:
        self.inner = _transform()
        self.calls = 0

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("the transform failed")
        return self.inner(images)


def _collect(worker_id: int) -> None:
    gc.collect()  # in a new worker: collects what the parent left as garbage when it forked


def test_workers_do_not_linger_after_an_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ds = FolderDataset(_folder(tmp_path / "d", 16))
    before = set(multiprocessing.active_children())
    gc.disable()  # what a cycle would hold stays held, as between two collections
    try:
        loader = ds.dataloader(batch_size=2, num_workers=2, device="cpu", gpu_transform=_FailsOnce(),
                               worker_init_fn=_collect, multiprocessing_context="fork")  # fmt: skip
        with pytest.raises(RuntimeError, match="the transform failed") as info:
            list(loader)
        # The error, its traceback and the loop's frames are all still held here.
        deadline = time.monotonic() + 15
        while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not set(multiprocessing.active_children()) - before, "the failed epoch's workers are alive"
        del info
        assert sum(len(t) for _, t in loader) == 16  # the next epoch's workers collect in their first breath
    finally:
        gc.enable()
    assert "can only test a child process" not in capfd.readouterr().err


# -- 9. decode and transform overlap; grayscale on the device; CPU fallbacks in the workers --------------
class _Pillow:
    """A device decoder (Pillow) that records what it gets and signals each batch it starts."""

    name = "stand-in"

    def __init__(self) -> None:
        self.started = [threading.Event() for _ in range(16)]
        self.batches = 0
        self.got: list[bytes] = []

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        self.started[self.batches].set()
        self.batches += 1
        out: list[torch.Tensor | None] = []
        for d in datas:
            self.got.append(d.tobytes())
            with Image.open(io.BytesIO(d.tobytes())) as img:
                out.append(torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1))
        return out


class _WaitsForTheNextDecode:
    def __init__(self, decoder: _Pillow) -> None:
        self.decoder = decoder
        self.inner = _transform()
        self.overlapped: list[bool] = []

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        k = len(self.overlapped)
        # Batch k+1's decode starts while batch k is transformed, or never (a serial producer).
        self.overlapped.append(self.decoder.started[k + 1].wait(timeout=10))
        return self.inner(images)


def test_decode_and_transform_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = _Pillow()
    monkeypatch.setattr(_decoders, "for_device", lambda device: decoder)
    transform = _WaitsForTheNextDecode(decoder)
    ds = FolderDataset(_folder(tmp_path / "d", 12))
    loader = ds.dataloader(batch_size=3, device="cpu", gpu_transform=transform)
    assert sum(len(t) for _, t in loader) == 12
    assert transform.overlapped[:3] == [True, True, True]


def test_grayscale_goes_to_the_device_and_the_workers_decode_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = {
        "a/0.jpg": _jpeg(0, 50, 60),
        "a/1.png": _jpeg(1, 33, 47, fmt="PNG"),
        "b/2.jpg": _jpeg(2, 45, 45, mode="CMYK"),
        "b/3.jpg": _jpeg(3, 70, 30, mode="L"),
    }
    for key, data in objects.items():
        (tmp_path / "d" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "d" / key).write_bytes(data)
    decoder = _Pillow()
    monkeypatch.setattr(_decoders, "for_device", lambda device: decoder)
    loader = FolderDataset(tmp_path / "d").dataloader(batch_size=4, num_workers=2, device="cpu",
                                                      gpu_transform=_transform())  # fmt: skip
    ((images, targets),) = list(loader)
    assert images.shape == (4, 3, 16, 16) and targets.tolist() == [0, 0, 1, 1]
    assert sorted(decoder.got) == sorted([objects["a/0.jpg"], objects["b/3.jpg"]])  # RGB and grayscale JPEGs
    s = loader.stats()
    assert (s.device_decoded, s.worker_decoded, s.device_refused) == (2, 2, 0)  # PNG and CMYK in the workers


# -- 10. fewer copies of each batch's bytes ---------------------------------------------------------------
def _collate_in_worker(samples: list[tuple[bytes, str, int]]) -> tuple[bool, RawBatch]:
    raw = collate_raw(samples)
    return raw.data.is_shared(), raw


def test_a_workers_raw_batch_is_made_in_shared_memory_and_not_pinned() -> None:
    samples = [(bytes([k]) * (k + 1), f"u{k}", k) for k in range(4)]
    loader = torch.utils.data.DataLoader(
        [samples], batch_size=None, num_workers=1, collate_fn=lambda s: _collate_in_worker(s),
        multiprocessing_context="fork",
    )  # fmt: skip
    ((shared, raw),) = list(loader)
    assert shared  # allocated there in shared memory: pickling it sends a handle, not the bytes again
    assert raw.pin_memory() is raw  # pin_memory=True does not copy bytes meant for a decoder
    views = raw.samples()
    assert [v.tobytes() for v in views] == [s for s, _, _ in samples]
    assert all(np.shares_memory(v, raw.data.numpy()) for v in views if len(v))  # views, not copies

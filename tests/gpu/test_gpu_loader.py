"""The loader's device path (``ds.dataloader(device=..., gpu_transform=...)``) on ``device="cpu"``: the
same batches as decoding and transforming by hand, fallbacks, bad samples, clean shutdown, resume,
DDP samplers, and the configuration errors. The CUDA check skips where there is no GPU."""

from __future__ import annotations

import io
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from blobdata import BlobdataError, ConfigError, DecodeError, FolderDataset, gpu
from blobdata.gpu._pipeline import DevicePipeline, RawBatch, collate_raw
from blobdata.gpu._transform import epoch_seed

pytestmark = pytest.mark.timeout(120)
SIZE = 24


def _jpeg(seed: int, h: int, w: int, mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _objects(n: int) -> dict[str, bytes]:
    """``c<k>/<i>.jpg`` JPEGs of different sizes (keys sort in index order within the listing)."""
    return {f"c{i % 3}/{i:03d}.jpg": _jpeg(i, 40 + 7 * i, 64 - 2 * i) for i in range(n)}


def _folder(root: Path, objects: dict[str, bytes]) -> Path:
    for key, data in objects.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def _transform(seed: int = 7) -> gpu.TrainTransform:
    return gpu.TrainTransform(SIZE, generator=torch.Generator().manual_seed(seed), channels_last=False)


def _decoder_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("blobdata-device-")]


def _no_decoder_thread_left() -> bool:
    deadline = time.monotonic() + 15
    while _decoder_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _decoder_threads()


@pytest.mark.network
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_equal_decoding_and_transforming_by_hand(
    s3_bucket: Any, tmp_path: Path, workers: int
) -> None:
    objects = _objects(11)
    s3_bucket.put_many({f"d/{k}": v for k, v in objects.items()})
    ds = FolderDataset(s3_bucket.url("d"), storage_options=s3_bucket.storage_options, cache=tmp_path / "c")
    gen = torch.Generator().manual_seed(5)
    loader = ds.dataloader(batch_size=4, num_workers=workers, device="cpu", gpu_transform=_transform(),
                           generator=gen)  # fmt: skip
    # The boxes and flips a TrainTransform draws from the loader's seed, the epoch and each URL.
    reference, seed = _transform(), epoch_seed(5, 0)
    by_url = {s3_bucket.url(f"d/{k}"): v for k, v in objects.items()}
    urls = [url for url, _ in ds.samples]
    got = list(loader)
    assert [len(t) for _, t in got] == [4, 4, 3]
    for k, (images, targets) in enumerate(got):
        chunk = urls[4 * k : 4 * k + 4]
        decoded = gpu.decode_batch([by_url[u] for u in chunk], chunk, device="cpu")
        sizes = np.array([im.shape[1:] for im in decoded])
        keys = np.array([zlib.crc32(u.encode()) for u in chunk])
        want = reference.apply(decoded, *reference.draw_keyed(sizes, keys, seed))
        assert images.shape == (len(chunk), 3, SIZE, SIZE) and images.dtype == torch.float32
        assert torch.equal(images, want)
        assert targets.tolist() == [ds.targets[4 * k + j] for j in range(len(chunk))]
    s = loader.stats()
    assert s.samples == 11 and s.samples_from_bucket == 11 and s.decode_s_per_sample > 0
    assert _no_decoder_thread_left()


def test_png_cmyk_and_grayscale_fall_back(tmp_path: Path) -> None:
    objects = {
        "a/0.jpg": _jpeg(0, 50, 60),
        "a/1.png": _jpeg(1, 33, 47, fmt="PNG"),
        "b/2.jpg": _jpeg(2, 45, 45, mode="CMYK"),
        "b/3.jpg": _jpeg(3, 70, 30, mode="L"),
    }
    ds = FolderDataset(_folder(tmp_path / "d", objects))
    loader = ds.dataloader(batch_size=4, device="cpu", gpu_transform=_transform())
    ((images, targets),) = list(loader)
    assert images.shape == (4, 3, SIZE, SIZE) and torch.isfinite(images).all()
    assert targets.tolist() == [0, 0, 1, 1]
    gray = images[3]  # a grayscale image decodes to three equal channels before normalising
    mean = torch.tensor(gpu.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(gpu.IMAGENET_STD).view(3, 1, 1)
    raw = gray * std + mean
    assert torch.allclose(raw[0], raw[1], atol=1e-4) and torch.allclose(raw[1], raw[2], atol=1e-4)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_sample_raises_with_its_url_or_is_skipped(tmp_path: Path, workers: int) -> None:
    objects = _objects(8)
    objects["c1/004.jpg"] = objects["c1/004.jpg"][:200]  # a truncated JPEG
    root = _folder(tmp_path / "d", objects)
    ds = FolderDataset(root)
    loader = ds.dataloader(batch_size=4, num_workers=workers, device="cpu", gpu_transform=_transform())
    with pytest.raises(DecodeError, match=r"004\.jpg") as info:
        list(loader)
    assert info.value.url is not None and info.value.url.endswith("004.jpg")
    assert _no_decoder_thread_left()

    skipping = FolderDataset(root, on_error="skip")
    loader = skipping.dataloader(batch_size=4, num_workers=workers, device="cpu", gpu_transform=_transform())
    batches = list(loader)
    assert sum(len(t) for _, t in batches) == 7
    ((url, exc),) = skipping.errors
    assert url.endswith("c1/004.jpg") and isinstance(exc, DecodeError) and exc.url == url
    assert loader.stats().errors_skipped == 1


def _named_target(target: int) -> tuple[int, str]:
    return target, f"class {target}"


def test_a_skipped_sample_leaves_every_field_of_structured_targets(tmp_path: Path) -> None:
    objects = _objects(6)
    objects["c1/004.jpg"] = objects["c1/004.jpg"][:200]  # a truncated JPEG, second in its batch
    ds = FolderDataset(_folder(tmp_path / "d", objects), on_error="skip", target_transform=_named_target)
    loader = ds.dataloader(batch_size=3, device="cpu", gpu_transform=_transform())
    batches = list(loader)
    urls = [url for url, _ in ds.samples]
    kept = [i for i, url in enumerate(urls) if not url.endswith("004.jpg")]
    want = [ds.targets[i] for i in kept]
    assert [int(images.shape[0]) for images, _ in batches] == [3, 2]
    ids = [t for _, (ids, _) in batches for t in ids.tolist()]
    names = [n for _, (_, names) in batches for n in names]
    assert ids == want and names == [f"class {t}" for t in want]


def test_breaking_out_and_a_new_epoch_leave_no_thread_behind(tmp_path: Path) -> None:
    ds = FolderDataset(_folder(tmp_path / "d", _objects(20)))
    loader = ds.dataloader(batch_size=2, num_workers=2, device="cpu", gpu_transform=_transform())
    for _ in loader:
        break
    assert _no_decoder_thread_left()
    it = iter(loader)
    next(it)
    it = iter(loader)  # a new epoch while the last one is unfinished
    assert sum(len(t) for _, t in it) == 20
    del it
    assert _no_decoder_thread_left()


def test_resume_and_a_distributed_sampler(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", _objects(12))
    ds = FolderDataset(root)

    def loader(**kw: Any) -> Any:
        gen = torch.Generator().manual_seed(3)
        return ds.dataloader(batch_size=3, device="cpu", gpu_transform=_transform(), generator=gen, **kw)

    full = [t.tolist() for _, t in loader(shuffle=True)]
    first = loader(shuffle=True)
    it = iter(first)
    head = [next(it)[1].tolist() for _ in range(2)]
    state = first.state_dict()
    assert state["batches"] == 2  # what the loop received, not what the pipeline decoded ahead
    del it
    again = loader(shuffle=True)
    again.load_state_dict(state)
    assert head + [t.tolist() for _, t in again] == full

    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    mine = [t.tolist() for _, t in ds.dataloader(batch_size=3, sampler=sampler, device="cpu",
                                                 gpu_transform=_transform())]  # fmt: skip
    assert [t for batch in mine for t in batch] == [ds.targets[i] for i in list(sampler)]


def test_rebuilt_from_its_own_attributes(tmp_path: Path) -> None:
    """Lightning re-instantiates a loader from the attributes named like its constructor's arguments."""
    ds = FolderDataset(_folder(tmp_path / "d", _objects(10)))
    loader = ds.dataloader(batch_size=4, device="cpu", gpu_transform=_transform())
    again = type(loader)(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=loader.sampler,
        collate_fn=loader.collate_fn,
        device=loader.device,
        gpu_transform=loader.gpu_transform,
    )
    shapes = [tuple(images.shape) for images, _ in again]
    assert shapes == [(4, 3, SIZE, SIZE), (4, 3, SIZE, SIZE), (2, 3, SIZE, SIZE)]


def test_configuration_errors(tmp_path: Path) -> None:
    root = _folder(tmp_path / "d", _objects(3))
    ds = FolderDataset(root)
    with pytest.raises(ConfigError, match="go together"):
        ds.dataloader(batch_size=2, gpu_transform=_transform())
    with pytest.raises(ConfigError, match="go together"):
        ds.dataloader(batch_size=2, device="cpu")
    with pytest.raises(ConfigError, match="collate_fn"):
        ds.dataloader(batch_size=2, device="cpu", gpu_transform=_transform(), collate_fn=lambda b: b)
    with pytest.raises(ConfigError, match="without transform="):
        FolderDataset(root, transform=lambda im: im).dataloader(device="cpu", gpu_transform=_transform())
    with pytest.raises(ConfigError, match="without loader="):
        FolderDataset(root, loader=lambda f: f.read()).dataloader(device="cpu", gpu_transform=_transform())
    with pytest.raises(ConfigError, match="'cuda' or 'cpu'"):
        ds.dataloader(device="meta", gpu_transform=_transform())
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            ds.dataloader(device="cuda", gpu_transform=_transform())
    # The dataset itself is untouched: it still decodes per sample for a plain loader.
    image, target = ds[0]
    assert isinstance(image, Image.Image) and target == 0


def test_raw_batches_cross_as_one_tensor() -> None:
    samples = [(b"abc", "u0", 1), (b"", "u1", 0), (b"\x00\xff", "u2", 2)]
    raw = collate_raw(samples)
    assert isinstance(raw, RawBatch) and raw.data.dtype == torch.uint8 and raw.data.numel() == 5
    assert [v.tobytes() for v in raw.samples()] == [b"abc", b"", b"\x00\xff"]
    assert raw.urls == ["u0", "u1", "u2"]
    assert raw.targets == [1, 0, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_match_the_cpu_path(tmp_path: Path) -> None:  # pragma: no cover - GPU machines only
    ds = FolderDataset(_folder(tmp_path / "d", _objects(16)))
    cpu = [b for b, _ in ds.dataloader(batch_size=8, device="cpu", gpu_transform=_transform())]
    cuda = list(ds.dataloader(batch_size=8, num_workers=2, device="cuda", gpu_transform=_transform()))
    for want, (images, targets) in zip(cpu, cuda, strict=True):
        assert images.is_cuda and targets.is_cuda
        # nvJPEG and libjpeg-turbo may differ by a few levels per pixel (IDCT and upsampling).
        assert (images.float().cpu() - want).abs().mean() < 0.1
    assert _no_decoder_thread_left()


def test_persistent_workers_and_a_new_iter_mid_epoch(tmp_path: Path) -> None:
    ds = FolderDataset(_folder(tmp_path / "d", _objects(12)))
    loader = ds.dataloader(
        batch_size=3, num_workers=2, persistent_workers=True, device="cpu", gpu_transform=_transform()
    )
    it = iter(loader)
    next(it)
    # The same workers, reset for a new epoch; the old epoch's decode thread is stopped first.
    assert sum(len(t) for _, t in loader) == 12
    assert sum(len(t) for _, t in loader) == 12
    # The first epoch's iterator was stopped by the second: it ends (it does not hang) after what
    # its thread had already queued.
    assert len(list(it)) <= 2
    del it
    assert _no_decoder_thread_left()


def test_a_decode_thread_that_cannot_stop_is_a_clear_error() -> None:
    release = threading.Event()

    def stuck() -> Iterator[RawBatch]:  # a worker that does not deliver its batch until released
        release.wait(30)
        yield from ()

    pipeline = DevicePipeline(_transform(), "cpu")
    ended: list[list[Any]] = []
    consumer = threading.Thread(target=lambda: ended.append(list(pipeline(stuck()))))
    consumer.start()
    deadline = time.monotonic() + 10
    while pipeline._running is None and time.monotonic() < deadline:  # its decode thread started
        time.sleep(0.01)
    try:
        with pytest.raises(BlobdataError, match=r"did not stop within 0 s \(a worker is stuck\)"):
            pipeline.stop_previous(timeout=0.3)
    finally:
        release.set()
    consumer.join(10)
    assert ended == [[]]  # the stopped epoch ends once its thread does
    assert _no_decoder_thread_left()


class _Counting:
    """A gpu_transform that records every batch it is asked to transform."""

    def __init__(self) -> None:
        self.inner = _transform()
        self.calls = 0

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        return self.inner(images)


def test_the_decode_thread_stays_a_bounded_number_of_batches_ahead(tmp_path: Path) -> None:
    ds = FolderDataset(_folder(tmp_path / "d", _objects(24)))
    counting = _Counting()
    loader = ds.dataloader(batch_size=2, num_workers=2, device="cpu", gpu_transform=counting)
    assert loader.device_pipeline is not None
    depth = loader.device_pipeline.depth
    it = iter(loader)
    next(it)  # the loop now "trains" on batch 0 and asks for nothing more
    deadline = time.monotonic() + 30
    while counting.calls < 1 + depth and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # without a bound on the queue, more batches would be decoded meanwhile
    # Batch 0 handed over, `depth` batches queued, one more decoded and waiting for room: no more.
    assert 1 + depth <= counting.calls <= 2 + depth
    assert sum(len(t) for _, t in it) == 22
    assert counting.calls == 12

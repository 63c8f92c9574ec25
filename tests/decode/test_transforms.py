"""blobdata.transforms.RandomResizedCrop: the box distribution, the reduced-scale decode against a full
decode, odd inputs, and its use as a dataset's transform (bytes in, tensor out)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from blobdata import DecodeError, FolderDataset
from blobdata.testing import synthetic_jpeg
from blobdata.transforms import DecodeAware, RandomResizedCrop


def _encode(img: Image.Image, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, quality=90) if fmt == "JPEG" else img.save(buf, fmt)
    return buf.getvalue()


def test_box_distribution_stays_within_scale_and_ratio() -> None:
    g = torch.Generator().manual_seed(1)
    crop = RandomResizedCrop(32, scale=(0.2, 0.9), ratio=(0.5, 2.0), generator=g)
    areas, ratios = [], []
    for _ in range(2000):
        top, left, h, w = crop.params(640, 480)
        assert top >= 0 and top + h <= 480 and left >= 0 and left + w <= 640
        areas.append(h * w / (640 * 480))
        ratios.append(w / h)
    assert min(areas) >= 0.19 and max(areas) <= 0.91
    assert min(ratios) >= 0.49 and max(ratios) <= 2.02
    # Where every draw fits (a square image, small areas): uniform areas, log-uniform ratios.
    g2 = torch.Generator().manual_seed(2)
    small = RandomResizedCrop(8, scale=(0.05, 0.3), ratio=(0.5, 2.0), generator=g2)
    boxes = [small.params(1000, 1000) for _ in range(2000)]
    assert abs(np.mean([h * w / 1e6 for _, _, h, w in boxes]) - 0.175) < 0.01
    assert 0.45 < np.mean([w > h for _, _, h, w in boxes]) < 0.55


def test_fallback_is_a_central_crop() -> None:
    crop = RandomResizedCrop(8, scale=(2.0, 3.0), ratio=(1.0, 1.0))  # no draw can fit: fallback
    assert crop.params(100, 50) == (0, 25, 50, 50)


def test_output_shape_dtype_and_flip() -> None:
    data = synthetic_jpeg(np.random.default_rng(0))
    out = RandomResizedCrop((20, 30), flip=0.0).decode_and_apply(data, "s3://b/x.jpg")
    assert out.shape == (3, 20, 30) and out.dtype == torch.uint8
    img = Image.open(io.BytesIO(data))
    box = RandomResizedCrop(24).params(*img.size)
    plain = RandomResizedCrop(24, flip=0.0).crop(Image.open(io.BytesIO(data)), box, reduced=False)
    flipper = RandomResizedCrop(24, flip=1.0)
    flipped = flipper._finish(Image.open(io.BytesIO(data)), box, (1.0, 1.0), True)
    assert torch.equal(flipped, plain.flip(-1))


def test_full_decode_matches_the_usual_pil_pipeline() -> None:
    """The crop is resized by torch's antialiased uint8 kernel: it must give what torchvision's PIL
    path (crop, BILINEAR resize, PILToTensor) gives for the same box, down- and upscaling."""
    rng = np.random.default_rng(7)
    g = torch.Generator().manual_seed(7)
    crop = RandomResizedCrop((48, 64), scale=(0.01, 1.0), flip=0.0, generator=g)
    diffs, worst = [], 0
    for _ in range(20):
        img = Image.open(io.BytesIO(synthetic_jpeg(rng, min_side=80, max_side=300))).convert("RGB")
        top, left, h, w = box = crop.params(*img.size)
        ours = crop.crop(img, box, reduced=False)
        usual = img.crop((left, top, left + w, top + h)).resize((64, 48), Image.Resampling.BILINEAR)
        diff = (ours.float() - torch.from_numpy(np.array(usual)).permute(2, 0, 1).float()).abs()
        diffs.append(diff.mean().item())
        worst = max(worst, int(diff.max().item()))
    assert ours.shape == (3, 48, 64) and ours.is_contiguous()
    assert np.mean(diffs) < 0.5 and worst <= 3, (diffs, worst)


@pytest.mark.parametrize(("upsample", "bound"), [(1.0, 3.0), (2.0, 6.0)])
def test_reduced_scale_decode_matches_a_full_decode(upsample: float, bound: float) -> None:
    rng = np.random.default_rng(3)
    crop = RandomResizedCrop(64, flip=0.0, upsample=upsample, generator=torch.Generator().manual_seed(3))
    reduced_some = 0
    diffs = []
    for _ in range(30):
        data = synthetic_jpeg(rng, min_side=500, max_side=900)
        box = crop.params(*Image.open(io.BytesIO(data)).size)
        full = crop.crop(Image.open(io.BytesIO(data)), box, reduced=False)
        img = Image.open(io.BytesIO(data))
        fast = crop.crop(img, box, reduced=True)
        reduced_some += img.size != Image.open(io.BytesIO(data)).size
        diffs.append((full.float() - fast.float()).abs().mean().item())
    assert reduced_some >= 10  # the reduced path was taken: the comparison means something
    assert np.mean(diffs) < bound, diffs


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGBA", "P"])
def test_other_modes_and_formats(mode: str) -> None:
    arr = np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    fmt = "PNG" if mode in ("RGBA", "P") else "JPEG"
    out = RandomResizedCrop(16).decode_and_apply(_encode(img, fmt), f"s3://b/x.{fmt.lower()}")
    assert out.shape == (3, 16, 16) and out.dtype == torch.uint8


def test_as_a_dataset_transform_and_corrupt_bytes(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    for i in range(4):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i}.jpg").write_bytes(synthetic_jpeg(rng))
    (tmp_path / "c1" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    crop = RandomResizedCrop(32)
    assert isinstance(crop, DecodeAware)
    ds = FolderDataset(tmp_path, transform=crop, lookahead=0)
    batch = next(iter(ds.dataloader(batch_size=2)))
    assert batch[0].shape == (2, 3, 32, 32) and batch[0].dtype == torch.uint8
    bad = next(i for i, (p, _) in enumerate(ds.samples) if p.endswith("bad.jpg"))
    with pytest.raises(DecodeError) as info:
        ds[bad]
    assert "bad.jpg" in str(info.value) and info.value.url is not None and info.value.url.endswith("bad.jpg")
    assert math.isfinite(float(batch[0].float().mean()))

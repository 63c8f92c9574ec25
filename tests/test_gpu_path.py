"""blobdata.gpu on CPU tensors: the batched augmentation against per-sample reference crops, the decode
fallbacks, the clear error without a GPU decoder. GPU-only checks skip where CUDA is missing."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from blobdata import ConfigError, DecodeError, gpu


def _image(h: int, w: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC))
    return torch.from_numpy(smooth.copy()).permute(2, 0, 1)


def test_batched_crops_match_per_sample_references() -> None:
    images = [_image(120, 160, 0), _image(90, 70, 1), _image(200, 130, 2), _image(64, 64, 3)]
    t = gpu.TrainTransform(48, mean=(0, 0, 0), std=(1 / 255, 1 / 255, 1 / 255), channels_last=False,
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    boxes, flips = t.draw([(int(i.shape[1]), int(i.shape[2])) for i in images])
    flips = [False, True, False, True]
    out = t.apply(images, boxes, flips)
    assert out.shape == (4, 3, 48, 48) and out.dtype == torch.float32
    for k, (im, (top, left, h, w), flip) in enumerate(zip(images, boxes, flips, strict=True)):
        crop = im[:, top : top + h, left : left + w].float()[None]
        ref = F.interpolate(crop, size=(48, 48), mode="bilinear", align_corners=False)[0]
        if flip:
            ref = ref.flip(-1)
        err = (out[k] - ref).abs()
        # Same sample positions; only the outermost ring may read one pixel past the crop (bilinear).
        assert err[:, 1:-1, 1:-1].mean() < 0.5 and err.mean() < 2.0, (k, float(err.mean()))


def test_normalise_dtype_and_channels_last() -> None:
    t = gpu.TrainTransform(16, dtype=torch.bfloat16)
    out = t([_image(40, 50, 4), _image(30, 30, 5)])
    assert out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=torch.channels_last)
    assert -3 < float(out.float().mean()) < 3  # normalised, not 0-255


def _jpeg(mode: str) -> bytes:
    img = Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, "JPEG" if mode in ("RGB", "L", "CMYK") else "PNG")
    return buf.getvalue()


def test_decode_batch_on_cpu_and_its_fallbacks() -> None:
    datas = [_jpeg("RGB"), _jpeg("L"), _jpeg("CMYK"), _jpeg("RGBA")]
    out = gpu.decode_batch(datas, [f"s3://b/{i}" for i in range(4)], device="cpu")
    assert [tuple(t.shape) for t in out] == [(3, 20, 30)] * 4 and all(t.dtype == torch.uint8 for t in out)
    with pytest.raises(DecodeError) as info:
        gpu.decode_batch([b"\xff\xd8broken"], ["s3://b/broken.jpg"], device="cpu")
    assert info.value.url == "s3://b/broken.jpg"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        gpu.decode_batch([_jpeg("RGB")], ["s3://b/x"], device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_matches_cpu() -> None:  # pragma: no cover - GPU machines only
    datas = [_jpeg("RGB"), _jpeg("L")]
    try:
        out = gpu.decode_batch(datas, ["a", "b"], device="cuda")
    except ConfigError as exc:
        pytest.skip(str(exc))
    cpu = gpu.decode_batch(datas, ["a", "b"], device="cpu")
    for a, b in zip(out, cpu, strict=True):
        assert (a.cpu().float() - b.float()).abs().mean() < 2

"""blobdata.gpu on CPU tensors: the batched augmentation against per-sample reference crops, the decode
fallbacks, the clear error without a GPU decoder. GPU-only checks skip where CUDA is missing."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from blobdata import ConfigError, DecodeError, gpu
from blobdata.gpu import _decoders, _transform
from blobdata.gpu._jpeg import read_header
from tests.support import gpu_standins


def _image(h: int, w: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
    smooth = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC))
    return torch.from_numpy(smooth.copy()).permute(2, 0, 1)


@pytest.mark.parametrize("antialias", [True, False])
def test_batched_crops_match_per_sample_references(antialias: bool) -> None:
    sizes = [(120, 160), (90, 70), (200, 130), (64, 64), (30, 40)]
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    t = gpu.TrainTransform(48, mean=(0, 0, 0), std=(1 / 255, 1 / 255, 1 / 255), channels_last=False,
                           antialias=antialias, generator=torch.Generator().manual_seed(0))  # fmt: skip
    boxes, _ = t.draw([(int(i.shape[1]), int(i.shape[2])) for i in images])
    # Crops that shrink and crops that grow, at the images' edges, flipped or not.
    boxes[0] = (0, 0, 120, 160)
    boxes[3] = (64 - 20, 64 - 30, 20, 30)
    flips = [False, True, False, True, True]
    out = t.apply(images, boxes, flips)
    assert out.shape == (5, 3, 48, 48) and out.dtype == torch.float32
    for k, (im, (top, left, h, w), flip) in enumerate(zip(images, boxes, flips, strict=True)):
        crop = im[:, top : top + h, left : left + w].float()[None]
        ref = F.interpolate(crop, size=(48, 48), mode="bilinear", align_corners=False, antialias=antialias)[0]
        if flip:
            ref = ref.flip(-1)
        err = (out[k] - ref).abs()
        # The same filter weights as interpolate's, edges included: float rounding only.
        assert float(err.max()) < 0.01, (k, float(err.max()))


def test_a_large_image_does_not_make_the_whole_batch_large() -> None:
    boxes = [(0, 0, 3000, 4000)] + [(0, 0, 200 + k, 180) for k in range(63)]
    groups = _transform._groups(boxes, 16 * 210 * 200)
    assert sorted(k for g in groups for k in g) == list(range(64))
    assert [0] in groups  # the large crop is padded alone
    for g in groups:
        padded = len(g) * max(boxes[k][2] for k in g) * max(boxes[k][3] for k in g)
        assert padded <= 16 * 210 * 200 or len(g) == 1
    assert len(groups) <= 1 + 5  # 63 similar crops, about 16 to a group: a few groups, not one per crop


def test_grouping_and_float16_do_not_change_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    images = [_image(60 + 7 * k, 90 - 5 * k, k) for k in range(8)]
    t = gpu.TrainTransform(32, generator=torch.Generator().manual_seed(3))
    boxes, flips = t.draw([(int(i.shape[1]), int(i.shape[2])) for i in images])
    one = t.apply(images, boxes, flips)
    t.group_bytes = 3 * 4 * 2 * 90 * 90  # about two crops per group
    grouped: list[list[list[int]]] = []
    real_groups = _transform._groups
    monkeypatch.setattr(_transform, "_groups", lambda b, m: grouped.append(real_groups(b, m)) or grouped[-1])
    assert torch.allclose(t.apply(images, boxes, flips), one, atol=1e-4)
    assert len(grouped[-1]) >= 2  # apply resized in several groups, as group_bytes asked
    with pytest.raises(ConfigError, match="group_bytes must be positive"):
        gpu.TrainTransform(32, group_bytes=0)
    monkeypatch.setattr(_transform, "_work_dtype", lambda device: torch.float16)  # what a GPU computes in
    err = (t.apply(images, boxes, flips) - one).abs() * 255 * 0.226  # back to pixel values
    assert float(err.mean()) < 0.1 and float(err.max()) < 1.0, (float(err.mean()), float(err.max()))


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


def test_an_installed_gpu_decoder_that_cannot_start_is_passed_over_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # nvImageCodec's Decoder() raises RuntimeError("CUDA Runtime failure...") where its CUDA is newer
    # than the driver's: the stand-in package fails the same way (the real wheel needs a GPU).
    gpu_standins.install(tmp_path, monkeypatch)

    def fail(self: Any, **kwargs: Any) -> None:
        raise RuntimeError("CUDA Runtime failure: #35")

    monkeypatch.setattr(gpu_standins.Decoder, "__init__", fail)
    _decoders.forget()
    why = "nvImageCodec is installed but cannot decode here (RuntimeError: CUDA Runtime failure: #35)"
    try:
        with caplog.at_level("WARNING", logger="blobdata"):
            try:
                decoder = _decoders._make(torch.device("cuda", 0))
            except ConfigError as exc:  # nothing else to decode with: the error names why
                assert "pip install 'blobdata[gpu]'" in str(exc) and why in str(exc)
            else:
                assert decoder.name.startswith("torchvision")
        assert why in caplog.text
    finally:
        _decoders.forget()


def _encoded(mode: str, **save: Any) -> bytes:
    rgb = Image.fromarray(np.random.default_rng(7).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    rgb.convert(mode).save(buf, "PNG" if mode == "RGBA" else "JPEG", **save)
    return buf.getvalue()


def test_the_gpu_decoders_get_the_jpegs_they_take_and_nothing_else() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    takes = {
        "baseline": _encoded("RGB"),
        "grayscale": _encoded("L"),
        "progressive": _encoded("RGB", progressive=True),
        "optimised, 4:4:4": _encoded("RGB", optimize=True, subsampling=0),
        "EXIF and ICC profile": _encoded("RGB", exif=exif.tobytes(), icc_profile=b"\0" * 3000),
    }
    refuses = {
        "CMYK": _encoded("CMYK"),
        "PNG": _encoded("RGBA"),
        "empty": b"",
        "SOI only": b"\xff\xd8",
        "garbage after SOI": b"\xff\xd8" + bytes(range(256)),
        "header cut in the frame": (lambda b: b[: b.index(b"\xff\xc0") + 6])(_encoded("RGB")),
        "cut before the frame": (lambda b: b[: b.index(b"\xff\xc0")])(_encoded("RGB")),
    }
    for name, data in {**takes, **refuses}.items():
        assert _gpu_takes(data) == (name in takes), name
        if name in takes or name in ("grayscale", "CMYK"):  # what Pillow reads from the same header
            with Image.open(io.BytesIO(data)) as img:
                assert (img.mode in ("RGB", "L")) == _gpu_takes(data), name
    # 12-bit and arithmetic-coded frames go to the CPU decoder: the precision byte and the SOF marker.
    base = takes["baseline"]
    sof = base.index(b"\xff\xc0")
    assert not _gpu_takes(base[: sof + 4] + b"\x0c" + base[sof + 5 :])
    assert not _gpu_takes(base[:sof] + b"\xff\xc9" + base[sof + 2 :])


@given(st.binary(max_size=300))
def test_reading_a_header_never_raises(data: bytes) -> None:
    assert isinstance(_gpu_takes(b"\xff\xd8" + data), bool)


def _gpu_takes(data: bytes) -> bool:
    header = read_header(data)
    return header is not None and header.gpu

"""Transforms that sit next to the decoder, so they can make decoding cheaper.

:class:`RandomResizedCrop` is ImageNet training's usual crop (a random area and aspect ratio, resized
to ``size``, then a horizontal flip, as a uint8 CHW tensor), but it receives the object's *bytes*:
it reads the JPEG's dimensions from its header, draws the crop box on the full-size image, and asks
libjpeg for a reduced-scale decode (DCT scaling, 1/2, 1/4 or 1/8: Pillow's ``Image.draft``) as small
as still leaves the crop at least ``size`` pixels on each side, then resizes only the crop with
torch's antialiased uint8 bilinear kernel (Pillow's BILINEAR within a fraction of a level, at a third
of its CPU time). Its output matches a full decode's within resampling error (a few levels of 255 on
average at most; ``benchmarks/bench_decode.py`` prints both the time and the difference).

Use it as the dataset's ``transform``; a dataset hands the bytes to any transform that has
``decode_and_apply(data, url)`` (the :class:`DecodeAware` protocol) instead of decoding first::

    from blobdata import FolderDataset
    from blobdata.transforms import RandomResizedCrop
    ds = FolderDataset("s3://bucket/imagenet/train", transform=RandomResizedCrop(224))

PNG and other formats are decoded in full and cropped the same way; grayscale and CMYK images are
converted to RGB. A JPEG with more scans than ``blobdata._decode.jpeg.MAX_SCANS`` (a scan bomb: its
decoding cost is blocks x scans) is refused before anything is decoded, as the default loader refuses it.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ._decode import IMAGE_FORMATS, check_jpeg
from ._sampling import current_sample

__all__ = ["DecodeAware", "RandomResizedCrop"]

_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its central fallback


@runtime_checkable
class DecodeAware(Protocol):
    """A transform that decodes the object's bytes itself (so it can decode only what it needs).

    ``decode_and_apply`` returns the transformed sample; any exception it raises is reported as a
    :class:`~blobdata.DecodeError` naming ``url``.
    """

    def decode_and_apply(self, data: bytes, url: str) -> Any: ...


class RandomResizedCrop:
    """Random-resized crop to ``size`` x ``size`` (or ``(height, width)``), then a horizontal flip with
    probability ``flip``; a uint8 CHW tensor. ``scale`` (area fraction) and ``ratio`` (width / height)
    are drawn as torchvision's ``RandomResizedCrop.get_params`` draws them.

    Where the draws come from: read through a blobdata loader (``ds.dataloader(...)``), from the
    loader's seed, the epoch and the sample's URL (:func:`blobdata.sample_rng`'s keys; the same boxes
    :class:`blobdata.gpu.TrainTransform` draws on the GPU path), so the same loader seed gives the same
    pixels whatever the number of workers or a resume in between. Otherwise (``ds[i]``, a plain
    ``DataLoader``), or when ``generator`` is given, from ``generator`` (default: torch's global
    generator, seeded per DataLoader worker). ``reduce=False`` always decodes in full.

    ``upsample`` (default 1.0) is how far the decoded crop may be enlarged to ``size``: at 1.0 the
    reduced-scale decode keeps the crop at least ``size`` pixels on each side, so the output matches a
    full decode within resampling error; at 2.0 it may decode at half that resolution (one more DCT
    step: cheaper, softer; ``benchmarks/bench_decode.py`` prints the difference).
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        generator: torch.Generator | None = None,
        reduce: bool = True,
        upsample: float = 1.0,
    ) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if min(self.size) < 1:
            raise ValueError(f"size must be positive, got {size!r}")
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]) or not 0 <= flip <= 1:
            raise ValueError(f"need 0 < scale[0] <= scale[1], 0 < ratio[0] <= ratio[1], 0 <= flip <= 1; got "
                             f"scale={scale}, ratio={ratio}, flip={flip}")  # fmt: skip
        self.scale = scale
        self.ratio = ratio
        self.flip = flip
        self.generator = generator
        self.reduce = reduce
        if upsample < 1.0:
            raise ValueError(f"upsample must be >= 1.0, got {upsample}")
        self.upsample = upsample

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, flip={self.flip})"
        )

    # -- the crop box ---------------------------------------------------------------------------------
    DRAWS = 4 * _ATTEMPTS + 1
    """Uniforms one sample's keyed box and flip take (:meth:`keyed_params`)."""

    def keyed_params(self, sizes: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Boxes ``(top, left, h, w)`` (int64, ``(n, 4)``) and flips (bool, ``(n,)``) for images of
        ``sizes`` (``(n, 2)``: height, width) from ``u`` (``(n, DRAWS)`` uniforms in [0, 1)).

        torchvision's rule, vectorised: up to 10 tries of an area fraction in ``scale`` and a
        log-uniform aspect ratio in ``ratio``, the first that fits wins; else the central crop of the
        nearest allowed ratio. The CPU path (one sample) and the GPU path (a batch) share it.
        """
        sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
        n = len(sizes)
        height, width = sizes[:, :1], sizes[:, 1:]
        lo, hi = np.log(self.ratio[0]), np.log(self.ratio[1])
        target = height * width * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, :_ATTEMPTS])
        aspect = np.exp(lo + (hi - lo) * u[:, _ATTEMPTS : 2 * _ATTEMPTS])
        w = np.rint(np.sqrt(target * aspect))
        h = np.rint(np.sqrt(target / aspect))
        fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = fits.argmax(axis=1)
        rows = np.arange(n)
        h, w = h[rows, first], w[rows, first]
        height, width = height[:, 0], width[:, 0]
        top = np.floor(u[rows, 2 * _ATTEMPTS + first] * (height - h + 1))
        left = np.floor(u[rows, 3 * _ATTEMPTS + first] * (width - w + 1))
        # The fallback where no try fitted: the central crop of the nearest allowed aspect ratio.
        ratio = width / height
        fw = np.where(ratio > self.ratio[1], np.rint(height * self.ratio[1]), width)
        fh = np.where(ratio < self.ratio[0], np.rint(width / self.ratio[0]), height)
        none = ~fits.any(axis=1)
        h, w = np.where(none, fh, h), np.where(none, fw, w)
        top = np.where(none, (height - fh) // 2, top)
        left = np.where(none, (width - fw) // 2, left)
        boxes = np.stack([top, left, h, w], axis=1).astype(np.int64)
        flips = u[:, 4 * _ATTEMPTS] < self.flip
        return boxes, flips

    def _draw(self, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """The box and flip of the sample being transformed: keyed when a loader keys it."""
        draws = current_sample() if self.generator is None else None
        if draws is not None and draws.keyed:
            return self._keyed(width, height, draws.stream(self.DRAWS))
        return self.params(width, height), self._flip()

    def _keyed(
        self, width: int, height: int, u: Callable[[int], float]
    ) -> tuple[tuple[int, int, int, int], bool]:
        """:meth:`keyed_params` for one image, in plain Python (a few of the uniforms are drawn, not
        all 41): the same box and flip, at a fifth of the numpy version's time for one image."""
        area = height * width
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for a in range(_ATTEMPTS):
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u(a))
            aspect = math.exp(lo + (hi - lo) * u(_ATTEMPTS + a))
            w = round(math.sqrt(target * aspect))  # round half to even, as numpy's rint
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = math.floor(u(2 * _ATTEMPTS + a) * (height - h + 1))
                left = math.floor(u(3 * _ATTEMPTS + a) * (width - w + 1))
                return (top, left, h, w), u(4 * _ATTEMPTS) < self.flip
        return self._central(width, height), u(4 * _ATTEMPTS) < self.flip

    def _central(self, width: int, height: int) -> tuple[int, int, int, int]:
        """The fallback box: the central crop of the nearest allowed aspect ratio."""
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def params(self, width: int, height: int) -> tuple[int, int, int, int]:
        """A crop box ``(top, left, height, width)`` for an image of ``width`` x ``height`` pixels, drawn
        from ``generator`` (torch's global generator by default)."""
        g = self.generator
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1], generator=g).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=g).item())
            w = round(math.sqrt(target_area * aspect))
            h = round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
                left = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
                return top, left, h, w
        return self._central(width, height)

    def _flip(self) -> bool:
        return bool(self.flip > 0 and torch.rand(1, generator=self.generator).item() < self.flip)

    # -- applying it ----------------------------------------------------------------------------------
    def decode_and_apply(self, data: bytes, url: str) -> torch.Tensor:
        """Decode ``data`` (the bytes of ``url``) at the smallest scale the crop allows, then crop,
        resize and flip."""
        check_jpeg(data, url, libjpeg=True)  # a scan bomb is refused before libjpeg spends minutes on it
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
                width, height = img.size  # from the header: nothing decoded yet
                box, flip = self._draw(width, height)
                factor = self._reduce(img, box) if self.reduce and img.format == "JPEG" else (1.0, 1.0)
                return self._finish(img, box, factor, flip)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        """The same crop of an image already decoded (no reduced-scale decode is possible then)."""
        box, flip = self._draw(*img.size)
        return self._finish(img, box, (1.0, 1.0), flip)

    def crop(self, img: Image.Image, box: tuple[int, int, int, int], *, reduced: bool) -> torch.Tensor:
        """The crop of ``box`` without flip: with ``reduced``, from a reduced-scale decode of ``img``
        (a freshly opened JPEG). For comparing both paths (benchmarks, tests)."""
        factor = self._reduce(img, box) if reduced and img.format == "JPEG" else (1.0, 1.0)
        return self._finish(img, box, factor, False)

    def _reduce(self, img: Image.Image, box: tuple[int, int, int, int]) -> tuple[float, float]:
        """Ask libjpeg for the smallest DCT scale that keeps the crop >= size; the scales applied."""
        width, height = img.size
        _, _, h, w = box
        out_h, out_w = self.size
        # The decoded image must be at least this large for the crop to keep out_w x out_h pixels.
        need_w = math.ceil(width * out_w / (w * self.upsample))
        need_h = math.ceil(height * out_h / (h * self.upsample))
        if need_w >= width or need_h >= height:
            return 1.0, 1.0
        img.draft("RGB", (need_w, need_h))
        return img.size[0] / width, img.size[1] / height

    def _finish(
        self, img: Image.Image, box: tuple[int, int, int, int], factor: tuple[float, float], flip: bool
    ) -> torch.Tensor:
        top, left, h, w = box
        fx, fy = factor
        if img.mode != "RGB":
            img = img.convert("RGB")  # grayscale, CMYK, palette, alpha
        # The box in the decoded image's pixels. After a reduced-scale decode it is rounded to whole
        # decoded pixels: at most half of one off, which the comparison with a full decode includes.
        x0, y0 = min(round(left * fx), img.width - 1), min(round(top * fy), img.height - 1)
        x1 = min(max(round((left + w) * fx), x0 + 1), img.width)
        y1 = min(max(round((top + h) * fy), y0 + 1), img.height)
        region = torch.from_numpy(np.array(img.crop((x0, y0, x1, y1))))  # HWC uint8: a copy of the crop
        # torch's uint8 antialiased bilinear resize gives Pillow's BILINEAR resize within a fraction
        # of a level, at a third of its CPU time (on a channels-last view: no transpose copy).
        small = F.interpolate(
            region.permute(2, 0, 1).unsqueeze(0), size=self.size, mode="bilinear", antialias=True
        )[0]
        if flip:
            small = small.flip(-1)
        return small.contiguous()

"""Batched decode and augmentation for a GPU (or any torch device): whole batches, few kernels.

:class:`TrainTransform` takes a batch of decoded images of different sizes (uint8 CHW tensors on one
device) and makes the training batch in a handful of batched kernels: per-sample random-resized-crop
boxes are drawn on the CPU (as torchvision draws them), the images are padded into one tensor, one
``grid_sample`` resizes every crop (the horizontal flip is folded into each sample's affine grid), then
one normalisation, one cast, channels-last. It runs on CPU tensors too, where it is tested against
per-sample crops resized with ``torch.nn.functional.interpolate``.

:func:`decode_batch` decodes a batch of JPEG bytes on the device: nvImageCodec (``nvidia-nvimgcodec``,
the hardware JPEG decoder of A100/H100-class GPUs) or torchvision's nvJPEG ``decode_jpeg`` when
installed (``pip install blobdata[gpu]``), with a per-sample Pillow fallback for what the GPU decoder
refuses (PNG, CMYK, grayscale JPEGs); corrupt bytes raise :class:`~blobdata.DecodeError` naming the
object URL. On ``device="cpu"`` it decodes with Pillow, so the whole path runs without a GPU.

``ds.dataloader(..., device="cuda", gpu_transform=TrainTransform(224))`` runs both in the training
process on a side CUDA stream, batch k+1 while the model trains on batch k (:mod:`._pipeline`).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .._decode import decode, default_loader
from .._errors import BlobdataError, ConfigError
from ..transforms import RandomResizedCrop

__all__ = ["TrainTransform", "check_device", "decode_batch", "decode_each"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class TrainTransform:
    """Random-resized crop to ``size``, horizontal flip, normalise, cast: one batch at a time.

    ``scale``, ``ratio`` and ``flip`` mean what they mean in :class:`blobdata.transforms.RandomResizedCrop`
    (boxes drawn from ``generator``); ``mean``/``std`` are per channel on the 0-1 scale; ``dtype`` is the
    output's; ``channels_last`` sets its memory format.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: float = 0.5,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        self.boxes = RandomResizedCrop(size, scale=scale, ratio=ratio, flip=flip, generator=generator)
        self.size = self.boxes.size
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype = dtype
        self.channels_last = channels_last

    def __repr__(self) -> str:
        return f"gpu.TrainTransform(size={self.size}, dtype={self.dtype}, channels_last={self.channels_last})"

    def draw(self, sizes: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int, int, int]], list[bool]]:
        """Per-sample boxes ``(top, left, h, w)`` for images of ``(height, width)``, and flips."""
        boxes = [self.boxes.params(w, h) for h, w in sizes]
        flips = [self.boxes._flip() for _ in sizes]
        return boxes, flips

    def __call__(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """``images``: uint8 CHW tensors (3 channels) on one device; returns an NCHW batch of ``dtype``."""
        boxes, flips = self.draw([(int(im.shape[-2]), int(im.shape[-1])) for im in images])
        return self.apply(images, boxes, flips)

    def apply(
        self,
        images: Sequence[torch.Tensor],
        boxes: Sequence[tuple[int, int, int, int]],
        flips: Sequence[bool],
    ) -> torch.Tensor:
        """The batch for given boxes and flips (see :meth:`draw`)."""
        if not images:
            raise ValueError("an empty batch")
        device = images[0].device
        hp = max(int(im.shape[-2]) for im in images)
        wp = max(int(im.shape[-1]) for im in images)
        batch = torch.zeros((len(images), 3, hp, wp), dtype=torch.float32, device=device)
        for k, im in enumerate(images):  # copies only: the arithmetic below is batched
            batch[k, :, : im.shape[-2], : im.shape[-1]] = im
        theta = torch.zeros((len(images), 2, 3), dtype=torch.float32)
        for k, ((top, left, h, w), flip) in enumerate(zip(boxes, flips, strict=True)):
            # Output [-1, 1] -> the crop's edges, in the padded image's normalised coordinates.
            theta[k, 0, 0] = (-w if flip else w) / wp
            theta[k, 0, 2] = (2 * left + w) / wp - 1
            theta[k, 1, 1] = h / hp
            theta[k, 1, 2] = (2 * top + h) / hp - 1
        out_h, out_w = self.size
        grid = F.affine_grid(theta.to(device), [len(images), 3, out_h, out_w], align_corners=False)
        out = F.grid_sample(batch, grid, mode="bilinear", padding_mode="border", align_corners=False)
        mean = torch.tensor(self.mean, device=device).view(1, 3, 1, 1) * 255
        std = torch.tensor(self.std, device=device).view(1, 3, 1, 1) * 255
        out = ((out - mean) / std).to(self.dtype)
        return out.contiguous(memory_format=torch.channels_last) if self.channels_last else out


def _cpu_decode(data: bytes, url: str) -> torch.Tensor:
    img = decode(data, url, default_loader)  # DecodeError naming the URL for corrupt bytes
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


@functools.cache
def _gpu_decoder() -> Any:
    """The batched GPU JPEG decoder available here, or None (made once per process)."""
    try:
        from nvidia import nvimgcodec  # type: ignore[import-not-found]

        decoder = nvimgcodec.Decoder()

        def nv(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
            out: list[torch.Tensor | None] = []
            stream = torch.cuda.current_stream(device).cuda_stream  # the caller's (side) stream
            try:
                images = decoder.decode(datas, cuda_stream=stream)
            except TypeError:  # a release without the keyword: it decodes on its own stream, then syncs
                images = decoder.decode(datas)
            for img in images:
                out.append(None if img is None else torch.as_tensor(img, device=device).permute(2, 0, 1))
            return out

        return nv
    except ImportError:
        pass
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        return None

    def tv(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
        raw = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        try:
            return list(decode_jpeg(raw, mode=ImageReadMode.RGB, device=device))
        except RuntimeError:  # one refused image fails the batch: decode one by one
            out: list[torch.Tensor | None] = []
            for r in raw:
                try:
                    out.append(decode_jpeg(r, mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    out.append(None)
            return out

    return tv


def decode_batch(
    datas: Sequence[bytes], urls: Sequence[str], *, device: str | torch.device = "cuda"
) -> list[torch.Tensor]:
    """Decode a batch to uint8 CHW RGB tensors on ``device``.

    On a CUDA device: JPEGs on the GPU, anything it refuses with Pillow (then copied over). Raises
    :class:`~blobdata.ConfigError` when no GPU decoder is installed (``pip install blobdata[gpu]``) or
    CUDA is unavailable, and :class:`~blobdata.DecodeError` naming the URL for bytes nobody can decode.
    """
    out: list[torch.Tensor] = []
    for item in decode_each(datas, urls, device=device):
        if isinstance(item, BlobdataError):
            raise item
        out.append(item)
    return out


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, after checking it can decode (ConfigError saying what is missing)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"GPU decoding runs on 'cuda' or 'cpu' devices, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
    if _gpu_decoder() is None:
        raise ConfigError(
            "GPU decoding needs nvImageCodec or torchvision: pip install 'blobdata[gpu]' "
            "(nvidia-nvimgcodec-cu13 and torchvision), or decode on the CPU"
        )
    return dev


def decode_each(
    datas: Sequence[bytes], urls: Sequence[str], *, device: str | torch.device = "cuda"
) -> list[torch.Tensor | BlobdataError]:
    """:func:`decode_batch` that returns, in place of each sample nobody can decode, its error."""
    return _decode_checked(datas, urls, check_device(device))


def _decode_checked(
    datas: Sequence[bytes], urls: Sequence[str], dev: torch.device
) -> list[torch.Tensor | BlobdataError]:
    """:func:`decode_each` on a device :func:`check_device` already accepted (the loader's per-batch call)."""
    if dev.type == "cpu":
        return [_cpu_decode_or_error(d, u) for d, u in zip(datas, urls, strict=True)]
    decoder = _gpu_decoder()
    jpeg = [d[:2] == b"\xff\xd8" and not _is_cmyk_or_gray(d) for d in datas]
    gpu_in = [d for d, j in zip(datas, jpeg, strict=True) if j]
    decoded = iter(decoder(gpu_in, dev) if gpu_in else [])
    out: list[torch.Tensor | BlobdataError] = []
    for d, u, j in zip(datas, urls, jpeg, strict=True):
        t = next(decoded) if j else None
        if t is None:  # not a JPEG the GPU takes (PNG, CMYK, grayscale) or refused by it
            cpu = _cpu_decode_or_error(d, u)
            t = cpu if isinstance(cpu, BlobdataError) else cpu.to(dev, non_blocking=True)
        out.append(t)
    return out


def _cpu_decode_or_error(data: bytes, url: str) -> torch.Tensor | BlobdataError:
    try:
        return _cpu_decode(data, url)
    except BlobdataError as exc:
        return exc


def _is_cmyk_or_gray(data: bytes) -> bool:
    """Whether a JPEG has other than 3 components (read from its header; cheap)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return bool(img.mode != "RGB")
    except Exception:
        return True  # let the CPU path say what is wrong with it

"""Batched decode and augmentation for a GPU (or any torch device): whole batches, few kernels.

:class:`TrainTransform` takes a batch of decoded images of different sizes (uint8 CHW tensors on one
device) and makes the training batch in a handful of batched kernels (:mod:`._transform`). It runs on
CPU tensors too, where it is tested against per-sample crops resized with
``torch.nn.functional.interpolate``: the same values, edges included.

:func:`decode_batch` decodes a batch of JPEG bytes on the device: nvImageCodec (``nvidia-nvimgcodec``,
the hardware JPEG decoder of A100/H100-class GPUs, then CUDA) or torchvision's nvJPEG ``decode_jpeg``
when installed (``pip install blobdata[gpu]``). Which samples go to the GPU is read from each JPEG's
frame header (:mod:`._jpeg`): 8-bit Huffman-coded JPEGs, grayscale ones included; PNG, CMYK, 12-bit and
arithmetic-coded ones are decoded with Pillow, and so is a JPEG the GPU decoder refuses (counted in
``loader.stats().device_refused``). A header larger than ``PIL.Image.MAX_IMAGE_PIXELS`` and bytes
nobody can decode raise :class:`~blobdata.DecodeError` naming the object URL. Both paths decode a JPEG
alike: EXIF orientation is not applied (Pillow and torchvision do not), chroma is upsampled as
libjpeg does. On ``device="cpu"`` the decoder is Pillow, so the whole path runs without a GPU.

``ds.dataloader(..., device="cuda", gpu_transform=TrainTransform(224))`` runs both in the training
process on side CUDA streams, in two stages, ahead of the loop (:mod:`._pipeline`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .._errors import BlobdataError, ConfigError
from . import _decoders
from ._batch import CPU, GPU, decode_views, join
from ._jpeg import check_header
from ._transform import IMAGENET_MEAN, IMAGENET_STD, TrainTransform

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "TrainTransform", "check_device", "decode_batch", "decode_each"]


def decode_batch(
    datas: Sequence[bytes], urls: Sequence[str], *, device: str | torch.device = "cuda"
) -> list[torch.Tensor]:
    """Decode a batch to uint8 CHW RGB tensors on ``device``.

    On a CUDA device: JPEGs on the GPU, anything it does not take or refuses with Pillow (then copied
    over). Raises :class:`~blobdata.ConfigError` when no GPU decoder is installed (``pip install
    blobdata[gpu]``) or CUDA is unavailable, and :class:`~blobdata.DecodeError` naming the URL for a
    decompression bomb or bytes nobody can decode.
    """
    out: list[torch.Tensor] = []
    for item in decode_each(datas, urls, device=device):
        if isinstance(item, BlobdataError):
            raise item
        out.append(item)
    return out


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, after checking it can decode (ConfigError saying what is missing).

    Nothing is started here: the decoder of each GPU is made on its first batch, in the thread that
    decodes (so a loader built before its workers fork starts no decoder threads, and under DDP each
    rank's decoder binds to its own GPU).
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"GPU decoding runs on 'cuda' or 'cpu' devices, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device={str(dev)!r}, but torch sees {torch.cuda.device_count()} CUDA devices")
    if not _decoders.available():
        raise ConfigError(
            "GPU decoding needs nvImageCodec or torchvision: pip install 'blobdata[gpu]' "
            "(nvidia-nvimgcodec-cu13 and torchvision), or decode on the CPU"
        )
    return dev


def decode_each(
    datas: Sequence[bytes], urls: Sequence[str], *, device: str | torch.device = "cuda"
) -> list[torch.Tensor | BlobdataError]:
    """:func:`decode_batch` that returns, in place of each sample nobody can decode, its error."""
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    buf, offsets = join(datas)
    views = [buf[a:b] for a, b in itertools.pairwise(offsets)]
    out: list[torch.Tensor | BlobdataError | None] = [None] * len(views)
    kinds, shapes = [], []
    for k, (view, url) in enumerate(zip(views, urls, strict=True)):
        header = None
        try:
            header = check_header(view, url)  # scan bombs, every frame's size: before any decoder runs
        except BlobdataError as exc:
            out[k] = exc
        kinds.append(GPU if out[k] is None and header is not None and header.gpu else CPU)
        shapes.append((header.height, header.width) if header is not None else (0, 0))
    todo = [k for k in range(len(views)) if out[k] is None]
    decoded, _ = decode_views(
        _decoders.for_device(dev),
        [views[k] for k in todo],
        [kinds[k] for k in todo],
        [shapes[k] for k in todo],
        [urls[k] for k in todo],
        dev,
    )
    for k, item in zip(todo, decoded, strict=True):
        out[k] = item
    return [x for x in out if x is not None]

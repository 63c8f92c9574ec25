"""Batched decode and augmentation for a GPU (or any torch device): whole batches, few kernels.

:class:`TrainTransform` takes a batch of decoded images of different sizes (uint8 CHW tensors on one
device) and makes the training batch in a handful of batched kernels: per-sample random-resized-crop
boxes are drawn on the CPU (as torchvision draws them), the crops are padded into one tensor (a few,
for batches of very different crop sizes), two batched matrix products resize every crop with
per-sample bilinear filter weights (antialiased; the horizontal flip is folded into the weights), then
one normalisation, one cast, channels-last. It runs on CPU tensors too, where it is tested against
per-sample crops resized with ``torch.nn.functional.interpolate``: the same values, edges included.

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
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._decode import decode, default_loader
from .._errors import BlobdataError, ConfigError
from ..transforms import RandomResizedCrop

__all__ = ["TrainTransform", "check_device", "decode_batch", "decode_each"]

_log = logging.getLogger("blobdata")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class TrainTransform:
    """Random-resized crop to ``size``, horizontal flip, normalise, cast: one batch at a time.

    ``scale``, ``ratio`` and ``flip`` mean what they mean in :class:`blobdata.transforms.RandomResizedCrop`
    (boxes drawn from ``generator``); ``mean``/``std`` are per channel on the 0-1 scale; ``dtype`` is the
    output's; ``channels_last`` sets its memory format. The resize is bilinear, antialiased when it shrinks
    (as ``torchvision.transforms.v2.RandomResizedCrop`` and :class:`blobdata.transforms.RandomResizedCrop`
    do) unless ``antialias=False``. ``group_bytes`` bounds the padded crops resized together (see
    :meth:`apply`): the transform's working memory, whatever the size of the photos in a batch.
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
        antialias: bool = True,
        group_bytes: int = 256 << 20,
        generator: torch.Generator | None = None,
    ) -> None:
        self.boxes = RandomResizedCrop(size, scale=scale, ratio=ratio, flip=flip, generator=generator)
        self.size = self.boxes.size
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype = dtype
        self.channels_last = channels_last
        self.antialias = antialias
        if group_bytes <= 0:
            raise ConfigError(f"group_bytes must be positive, got {group_bytes}")
        self.group_bytes = group_bytes

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
        """The batch for given boxes and flips (see :meth:`draw`).

        Each crop is resized by two matrix products, ``Wy @ crop @ Wx.T``, whose rows hold the resampling
        filter's weights for one output pixel: the same weights ``F.interpolate(mode="bilinear",
        antialias=...)`` uses, so a batch matches per-sample resizes, edges included. The crops (not the
        whole images) are padded to a common size in groups of similar crops of at most ``group_bytes``,
        so one large photo in a batch does not make the whole batch large.
        """
        if not images:
            raise ValueError("an empty batch")
        if not len(images) == len(boxes) == len(flips):
            raise ValueError(f"{len(images)} images, {len(boxes)} boxes and {len(flips)} flips")
        device = images[0].device
        work = _work_dtype(device)
        out_h, out_w = self.size
        out = torch.empty((len(images), 3, out_h, out_w), dtype=work, device=device)
        for group in _groups(boxes, self.group_bytes // (3 * torch.finfo(work).bits // 8)):
            hs, ws = [boxes[k][2] for k in group], [boxes[k][3] for k in group]
            ph, pw = max(hs), max(ws)
            crops = torch.zeros((len(group), 3, ph, pw), dtype=work, device=device)
            for i, k in enumerate(group):  # copies only: the arithmetic below is batched
                top, left, h, w = boxes[k]
                crops[i, :, :h, :w] = images[k][:, top : top + h, left : left + w]
            wy = _weights(hs, out_h, ph, [False] * len(group), antialias=self.antialias, device=device)
            wx = _weights(ws, out_w, pw, [flips[k] for k in group], antialias=self.antialias, device=device)
            wy, wx = wy.to(work)[:, None], wx.to(work)[:, None]
            # Resize along the dimension that leaves the smaller intermediate first.
            if out_h * pw <= ph * out_w:
                res = (wy @ crops) @ wx.transpose(-1, -2)
            else:
                res = wy @ (crops @ wx.transpose(-1, -2))
            out[_on(group, torch.long, device)] = res
        mean = _on(self.mean, torch.float32, device).view(1, 3, 1, 1) * 255
        std = _on(self.std, torch.float32, device).view(1, 3, 1, 1) * 255
        result = ((out.float() - mean) / std).to(self.dtype)
        return result.contiguous(memory_format=torch.channels_last) if self.channels_last else result


def _work_dtype(device: torch.device) -> torch.dtype:
    """The resize's dtype: float16 on a GPU (exact for 0-255 pixels, weights to 2**-11, float32 sums in the
    tensor cores: 0.04/255 from float32's result on average); float32 on the CPU (float16 is slow there)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def _groups(boxes: Sequence[tuple[int, int, int, int]], max_pixels: int) -> list[list[int]]:
    """Sample indices in groups of similar crop sizes whose padded crops hold at most ``max_pixels``
    (a single larger crop is a group of its own)."""
    order = sorted(range(len(boxes)), key=lambda k: (boxes[k][2], boxes[k][3]))
    groups: list[list[int]] = []
    group: list[int] = []
    ph = pw = 0
    for k in order:
        h, w = max(ph, boxes[k][2]), max(pw, boxes[k][3])
        if group and (len(group) + 1) * h * w > max_pixels:
            groups.append(group)
            group, h, w = [], boxes[k][2], boxes[k][3]
        group.append(k)
        ph, pw = h, w
    groups.append(group)
    return groups


def _weights(
    lengths: Sequence[int],
    out: int,
    padded: int,
    flips: Sequence[bool],
    *,
    antialias: bool,
    device: torch.device,
) -> torch.Tensor:
    """``(len(lengths), out, padded)`` float32 resampling weights: row ``i`` of sample ``k`` averages
    its crop's pixels ``< lengths[k]`` for output pixel ``i`` (mirrored where ``flips[k]``).

    The bilinear (triangle) filter, centred on the output pixel's centre in input coordinates and, with
    ``antialias`` when shrinking, widened by the scale factor; normalised to sum to 1 over the pixels
    that exist. That is PIL's and ``F.interpolate(..., antialias=True)``'s rule, and without
    ``antialias`` it is ``align_corners=False`` bilinear with clamped edges.
    """
    length = _on(lengths, torch.float32, device)[:, None, None]
    scale = length / out
    stretch = scale.clamp(min=1.0) if antialias else torch.ones_like(scale)
    i = torch.arange(out, dtype=torch.float32, device=device)[None, :, None]
    i = torch.where(_on(flips, torch.bool, device)[:, None, None], out - 1 - i, i)
    centre = (i + 0.5) * scale
    j = torch.arange(padded, dtype=torch.float32, device=device)[None, None, :]
    w = (1 - ((j + 0.5 - centre) / stretch).abs()).clamp(min=0) * (j < length)
    return w / w.sum(-1, keepdim=True)


def _on(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor on ``device`` without a host sync: pinned memory and an asynchronous copy on CUDA."""
    cpu = torch.tensor(values, dtype=dtype)
    return cpu.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else cpu


def _cpu_decode(data: bytes, url: str) -> torch.Tensor:
    img = decode(data, url, default_loader)  # DecodeError naming the URL for corrupt bytes
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


@functools.cache
def _gpu_decoder() -> Any:
    """The batched GPU JPEG decoder available here, or None (made once per process).

    A decoder that is installed but cannot run here (nvImageCodec built for a newer CUDA than the
    driver's, a torchvision built for another torch) is passed over with a warning that says why,
    and named in :func:`check_device`'s error if none is left.
    """
    _unusable.clear()
    try:
        from nvidia import nvimgcodec  # type: ignore[import-not-found]

        decoder = nvimgcodec.Decoder()
    except ImportError as exc:
        if exc.name not in ("nvidia", "nvidia.nvimgcodec"):  # there, but its libraries do not load
            _pass_over("nvImageCodec", exc)
    except Exception as exc:  # installed, but not usable with this driver or device
        _pass_over("nvImageCodec", exc)
    else:

        def nvimgcodec_decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
            out: list[torch.Tensor | None] = []
            stream = torch.cuda.current_stream(device).cuda_stream  # the caller's (side) stream
            try:
                images = decoder.decode(datas, cuda_stream=stream)
            except TypeError:  # a release without the keyword: it decodes on its own stream, then syncs
                images = decoder.decode(datas)
            for img in images:
                out.append(None if img is None else torch.as_tensor(img, device=device).permute(2, 0, 1))
            return out

        return nvimgcodec_decode
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as exc:
        if not isinstance(exc, ModuleNotFoundError) or exc.name != "torchvision":
            _pass_over("torchvision", exc)  # installed, but broken beside this torch
        return None
    except Exception as exc:
        _pass_over("torchvision", exc)
        return None

    def torchvision_decode_jpeg(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
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

    return torchvision_decode_jpeg


_unusable: list[str] = []  # GPU decoders installed here that failed to start, and why


def _pass_over(name: str, exc: BaseException) -> None:
    why = f"{name} is installed but cannot decode here ({type(exc).__name__}: {exc})"
    _unusable.append(why)
    _log.warning("blobdata.gpu: %s; trying the next decoder", why)


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
        why = "".join(f"; {u}" for u in _unusable)
        raise ConfigError(
            "GPU decoding needs nvImageCodec or torchvision: pip install 'blobdata[gpu]' "
            f"(nvidia-nvimgcodec-cu13 and torchvision), or decode on the CPU{why}"
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
    jpeg = [_gpu_takes(d) for d in datas]
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


# Start-of-frame markers of Huffman-coded JPEGs: baseline, extended sequential, progressive.
_SOF_HUFFMAN = frozenset((0xC0, 0xC1, 0xC2))
# The other SOFn (lossless, arithmetic-coded, hierarchical): the CPU decoder takes these.
_SOF_OTHER = frozenset(range(0xC3, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames


def _gpu_takes(data: bytes) -> bool:
    """Whether ``data`` is an 8-bit, 3-component, Huffman-coded JPEG: what the GPU decoders take.

    Reads the markers up to the frame header (0.7 us; opening it with Pillow to read its mode took
    16 us, per image, in the training process). Anything else (PNG, grayscale, CMYK,
    12-bit, arithmetic-coded, or a header this cannot read) goes to the CPU decoder, which names
    what is wrong with bytes it cannot decode.
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return False
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return False
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in _SOF_HUFFMAN:
            # length (2), precision (1), height (2), width (2), components (1)
            return i + 10 <= n and data[i + 4] == 8 and data[i + 9] == 3
        if marker in _SOF_OTHER or marker in (0xD9, 0xDA):  # other coding, or scan/end before a frame
            return False
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2:
            return False
        i += 2 + length
    return False

"""The batched augmentation: random-resized crop, flip, normalise and cast for a whole batch in a few kernels.

:class:`TrainTransform` takes a batch of decoded images of different sizes (uint8 CHW tensors on one
device). Per-sample crop boxes and flips are drawn on the CPU, as torchvision draws them; the crops
are padded into one tensor (a few, for batches of very different crop sizes), two batched matrix
products resize every crop with per-sample bilinear filter weights (antialiased; the flip is folded
into the weights), then one normalisation, one cast, channels-last.

In a loader (``ds.dataloader(device=..., gpu_transform=TrainTransform(...))``) the boxes and flips come
from :meth:`TrainTransform.draw_keyed`: a counter-based generator keyed by the loader's seed, the
epoch and each sample's URL, drawn for the whole batch at once with numpy. So the same loader seed
gives the same batches whatever torch's global generator holds, whatever the training loop draws,
however many workers there are, and after resuming mid-epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._errors import ConfigError
from .._sampling import epoch_seed, uniforms
from ..transforms import RandomResizedCrop

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "TrainTransform", "epoch_seed", "uniforms"]

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

    def draw_keyed(
        self, sizes: np.ndarray, keys: np.ndarray, seed: int
    ) -> tuple[list[tuple[int, int, int, int]], list[bool]]:
        """:meth:`draw` for a whole batch at once from a counter-based generator: sample k's box and
        flip depend only on ``seed``, ``keys[k]`` and its ``sizes[k]`` (``(height, width)``).

        torchvision's rule, vectorised: up to 10 tries of an area fraction in ``scale`` and a
        log-uniform aspect ratio in ``ratio``, the first that fits wins; else the central crop of the
        nearest allowed ratio. A few microseconds per batch, not a Python loop over samples.
        """
        sizes = np.asarray(sizes, dtype=np.float64).reshape(-1, 2)
        if len(sizes) == 0:
            return [], []
        boxes, flips = self.boxes.keyed_params(sizes, uniforms(seed, keys, self.boxes.DRAWS))
        return [tuple(b) for b in boxes.tolist()], flips.tolist()  # type: ignore[misc]

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

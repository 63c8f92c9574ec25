"""One batch through a device decoder: the JPEGs it takes to it, Pillow for what it refuses, counted.

Shared by :func:`blobdata.gpu.decode_each` and the loader's decode thread. Each sample is a uint8 view
of its bytes or of pixels, as ``kinds[k]`` says: :data:`GPU`, a JPEG the device decoder takes, of
``shapes[k]`` from its header; :data:`PIXELS`, ``(height, width, 3)`` RGB a worker already decoded;
:data:`CPU`, bytes the device decoder does not take (decoded with Pillow here). The device
decoder gets every JPEG of the batch in one call; a sample it refuses (None) is decoded with Pillow
here and counted in ``loader.stats().device_refused``; a sample nobody can decode comes back as its
:class:`~blobdata.DecodeError` naming the URL.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .._errors import BlobdataError
from .._metrics import stats as _stats
from ._decoders import DeviceDecoder, _check_count
from ._jpeg import cpu_pixels

__all__ = ["CPU", "GPU", "PIXELS", "decode_views", "join"]

GPU, PIXELS, CPU = 0, 1, 2


def join(datas: Sequence[bytes | np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Byte strings end to end in one writable uint8 array, and the offsets of each (one copy)."""
    offsets = [0]
    for d in datas:
        offsets.append(offsets[-1] + len(d))
    buf = np.empty(offsets[-1], dtype=np.uint8)
    for d, a, b in zip(datas, offsets, offsets[1:], strict=False):
        buf[a:b] = np.frombuffer(d, dtype=np.uint8) if isinstance(d, bytes) else np.asarray(d).reshape(-1)
    return buf, offsets


def decode_views(
    decoder: DeviceDecoder,
    views: Sequence[np.ndarray],
    kinds: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    urls: Sequence[str],
    device: torch.device,
) -> tuple[list[torch.Tensor | BlobdataError], int]:
    """(uint8 CHW RGB images on ``device``, or errors; how many JPEGs the device decoder refused)."""
    n = len(views)
    out: list[torch.Tensor | BlobdataError | None] = [None] * n
    sent = [k for k in range(n) if kinds[k] == GPU]
    if sent:
        got = decoder([views[k] for k in sent], device)
        _check_count(decoder.name, got, [views[k] for k in sent])
        for k, image in zip(sent, got, strict=True):
            if image is not None and tuple(image.shape) != (3, *shapes[k]):
                raise BlobdataError(
                    f"the GPU decoder {decoder.name} decoded {urls[k]} to {tuple(image.shape)} but its JPEG "
                    f"header says (3, {shapes[k][0]}, {shapes[k][1]}) (was its EXIF orientation applied?)"
                )
            out[k] = image
    refused = 0
    for k in range(n):
        if out[k] is not None:
            continue
        if kinds[k] != PIXELS:  # refused by the device decoder, or not for it: Pillow, here
            refused += kinds[k] == GPU
            try:
                pixels = np.array(cpu_pixels(views[k].tobytes(), urls[k]))
            except BlobdataError as exc:
                out[k] = exc
                continue
        else:  # decoded by a worker
            pixels = views[k].reshape(shapes[k][0], shapes[k][1], 3)
        out[k] = torch.from_numpy(pixels).permute(2, 0, 1).to(device, non_blocking=True)
    rec = _stats.rec()
    rec[_stats.DEVICE_DECODED] += len(sent) - refused
    rec[_stats.DEVICE_REFUSED] += refused
    return [x for x in out if x is not None], refused

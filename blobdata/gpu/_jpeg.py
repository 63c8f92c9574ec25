"""What a JPEG's markers say before anything is decoded, and the device path's per-sample work in a worker.

:func:`read_header` reads the markers up to the frame header (about a microsecond; opening the image
with Pillow took 16 us): the size, and whether the GPU decoders take it (8-bit, Huffman-coded, 1 or 3
components, not Adobe-RGB-coded). That decides, before any decoder runs, which samples go to the GPU
and which the CPU decodes, and lets Pillow's decompression-bomb rule (``PIL.Image.MAX_IMAGE_PIXELS``)
refuse a 65,500-pixel-square header before a GPU decoder allocates 13 GB for it.

:func:`prepare` is what a DataLoader worker does with each sample on the device path: a JPEG the GPU
takes stays bytes (after the bomb check); anything else (PNG, CMYK, 12-bit, arithmetic-coded) is
decoded here, in the worker, which has the bytes and a core, into RGB pixels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image

from .._decode import decode, default_loader
from .._errors import DecodeError
from .._metrics import stats as _stats

__all__ = ["Header", "check_pixels", "cpu_pixels", "prepare", "read_header"]

# Start-of-frame markers of Huffman-coded JPEGs: baseline, extended sequential, progressive.
_SOF_HUFFMAN = frozenset((0xC0, 0xC1, 0xC2))
# The other SOFn (lossless, arithmetic-coded, hierarchical): the CPU decoder takes these.
_SOF_OTHER = frozenset(range(0xC3, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
_APP14 = 0xEE


class Header(NamedTuple):
    """A JPEG's frame header: its size in pixels and whether the GPU decoders take it."""

    height: int
    width: int
    gpu: bool


def read_header(data: bytes | memoryview | np.ndarray) -> Header | None:
    """The frame header of ``data``, or None if it is not a JPEG whose frame header can be read.

    ``gpu`` is true for 8-bit, Huffman-coded (baseline, extended or progressive) JPEGs of 1 or 3
    components with a size in their header: what nvImageCodec and nvJPEG decode to RGB. A 3-component
    JPEG whose Adobe marker says its components are RGB, not YCbCr, goes to the CPU (libjpeg honours
    the marker; a GPU decoder assuming YCbCr would get its colours wrong).
    """
    buf = data if isinstance(data, bytes) else memoryview(data).cast("B")  # type: ignore[arg-type]
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    adobe_rgb = False
    i = 2
    while i + 4 <= n:
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in _SOF_HUFFMAN or marker in _SOF_OTHER:
            # length (2), precision (1), height (2), width (2), components (1)
            if i + 10 > n:
                return None
            height = (buf[i + 5] << 8) | buf[i + 6]
            width = (buf[i + 7] << 8) | buf[i + 8]
            components = buf[i + 9]
            gpu = (
                marker in _SOF_HUFFMAN
                and buf[i + 4] == 8
                and (components == 1 or (components == 3 and not adobe_rgb))
                and height > 0
                and width > 0
            )
            return Header(height, width, gpu)
        if marker in (0xD9, 0xDA):  # scan or end before a frame
            return None
        length = (buf[i + 2] << 8) | buf[i + 3]
        if length < 2:
            return None
        if marker == _APP14 and length >= 14 and i + 16 <= n and bytes(buf[i + 4 : i + 9]) == b"Adobe":
            adobe_rgb = buf[i + 15] == 0  # transform 0: the components are RGB (or CMYK), not YCbCr
        i += 2 + length
    return None


def check_pixels(height: int, width: int, url: str) -> None:
    """Pillow's decompression-bomb rule for a size read from a header: a :class:`DecodeError` naming
    ``url`` above ``PIL.Image.MAX_IMAGE_PIXELS`` (read now, so that a caller who raised it is heard)."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        raise DecodeError(
            f"refused to decode {url}: its JPEG header says {width}x{height} = {height * width} pixels, "
            f"more than PIL.Image.MAX_IMAGE_PIXELS ({limit}), a possible decompression bomb; raise "
            "PIL.Image.MAX_IMAGE_PIXELS if the image is genuine",
            url=url,
        )


def cpu_pixels(data: bytes, url: str) -> np.ndarray:
    """``data`` decoded with Pillow to RGB, ``(height, width, 3)`` uint8 (EXIF orientation not applied,
    as neither Pillow nor torchvision apply it); :class:`DecodeError` naming ``url`` if it cannot be."""
    img = decode(data, url, default_loader)
    return np.asarray(img)


def prepare(data: bytes, url: str) -> bytes | np.ndarray:
    """A worker's sample on the device path: the bytes of a JPEG the GPU takes, else its RGB pixels."""
    header = read_header(data)
    if header is not None and header.gpu:
        check_pixels(header.height, header.width, url)
        return data
    pixels = cpu_pixels(data, url)
    _stats.rec()[_stats.WORKER_DECODED] += 1
    return pixels

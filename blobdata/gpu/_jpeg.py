"""What a JPEG's markers say before anything is decoded, and the device path's per-sample work in a worker.

:func:`read_header` reads the markers (``blobdata._decode.walk_jpeg``, shared with the default loader):
the size of the largest frame, and whether the GPU decoders take it (one frame, 8-bit, Huffman-coded, 1
or 3 components, not Adobe-RGB-coded). That decides, before any decoder runs, which samples go to the
GPU and which the CPU decodes. :func:`check_header` is the guard: Pillow's decompression-bomb rule
(``PIL.Image.MAX_IMAGE_PIXELS``) refuses a 65,500-pixel-square frame (every frame is checked: a small
one first does not hide it) before a GPU decoder allocates 13 GB for it, and a JPEG with more scans than
``blobdata._decode.jpeg.MAX_SCANS`` (a scan bomb, whose cost is blocks x scans) is refused too.

:func:`prepare` is what a DataLoader worker does with each sample on the device path: a JPEG the GPU
takes stays bytes (after the bomb check); anything else (PNG, CMYK, 12-bit, arithmetic-coded) is
decoded here, in the worker, which has the bytes and a core, into RGB pixels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image

from .._decode import check_jpeg, decode, default_loader, walk_jpeg
from .._errors import DecodeError
from .._metrics import stats as _stats

__all__ = ["Header", "check_header", "check_pixels", "cpu_pixels", "prepare", "read_header"]


class Header(NamedTuple):
    """A JPEG's frame header: its size in pixels and whether the GPU decoders take it."""

    height: int
    width: int
    gpu: bool


def read_header(data: bytes | memoryview | np.ndarray, *, whole: bool = True) -> Header | None:
    """The frame header of ``data``, or None if it is not a JPEG with a frame header.

    The size is the largest frame's of all the file declares (``blobdata._decode.walk_jpeg``: every
    marker, entropy-coded data included). ``gpu`` is true for a JPEG of one frame, 8-bit, Huffman-coded
    (baseline, extended or progressive), of 1 or 3 components with a size in its header: what
    nvImageCodec and nvJPEG decode to RGB. A 3-component JPEG whose Adobe marker says its components are
    RGB, not YCbCr, goes to the CPU (libjpeg honours the marker; a GPU decoder assuming YCbCr would get
    its colours wrong). ``whole=False`` reads only up to the first scan: for bytes that
    :func:`prepare` has already walked in full.
    """
    markers = walk_jpeg(data, header_only=not whole)
    if markers is None or markers.frames == 0:
        return None
    return Header(markers.height, markers.width, markers.gpu)


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


def check_header(data: bytes | memoryview | np.ndarray, url: str) -> Header | None:
    """The device path's guard, before any decoder sees ``data``: :func:`read_header`, refusing (a
    :class:`DecodeError` naming ``url``) a JPEG with more scans than ``blobdata._decode.jpeg.MAX_SCANS``
    or whose largest frame is above ``PIL.Image.MAX_IMAGE_PIXELS``."""
    markers = check_jpeg(data, url)
    if markers is None or markers.frames == 0:
        return None
    check_pixels(markers.height, markers.width, url)
    return Header(markers.height, markers.width, markers.gpu)


def prepare(data: bytes, url: str) -> bytes | np.ndarray:
    """A worker's sample on the device path: the bytes of a JPEG the GPU takes, else its RGB pixels."""
    header = check_header(data, url)
    if header is not None and header.gpu:
        return data
    pixels = cpu_pixels(data, url)
    _stats.rec()[_stats.WORKER_DECODED] += 1
    return pixels

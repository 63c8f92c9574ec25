"""What a JPEG's markers say before anything decodes it: every frame (SOF) and the number of scans (SOS).

A JPEG's decoding cost is its blocks times its scans, and nothing in the format bounds the scans: a
195 KB progressive JPEG declaring 8192x8192 with 20,000 empty scans keeps libjpeg busy for about a minute
and a half. :func:`walk` counts the scans first, and :func:`check` refuses more than :data:`MAX_SCANS`
with a :class:`~blobdata.DecodeError` naming the object URL. The default loader,
``blobdata.transforms.RandomResizedCrop`` and the device path's header guard (``blobdata.gpu``) all call
it; the device path also takes its frame size from here, the largest of every frame the file declares
(a small frame first must not hide a large one from the decompression-bomb rule).

The walk reads markers as libjpeg does: a marker is ``0xFF`` (any number of fill ``0xFF``) then a code
other than ``0x00``; bytes that are not a marker where one is due are skipped, as libjpeg skips them.
Marker segments are skipped by their lengths (so an ``0xFFDA`` inside an EXIF thumbnail or a comment is
not a scan). Inside entropy-coded data ``0xFF 0x00`` is a data byte and ``RST0``-``RST7`` are restart
markers, not the end of the scan: the next other marker ends it, found by one compiled regular
expression (C speed, no Python loop per byte). It stops at EOI, where libjpeg stops.

What it costs (``benchmarks/bench_default_loader.py``, 170 KB photos): the walk in full reads every
byte once, about 3.5% of a Pillow decode (0.10-0.12 ms of 3 ms on a shared machine); that is the
device guard's. Pillow's paths (the default loader, RandomResizedCrop) walk with ``libjpeg=True``: a
baseline JPEG's walk stops at its one scan (0.7% of a decode, the headers only), a progressive one is
walked in full (1-1.5% of its slower decode).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from .._errors import DecodeError

if TYPE_CHECKING:
    import numpy as np

# The bytes of one object: as fetched, or a view of a batch's buffer (the device path).
Data: TypeAlias = "bytes | bytearray | memoryview | np.ndarray"

__all__ = ["MAX_SCANS", "Markers", "check", "walk"]

#: The most scans (SOS markers) a JPEG may have. Encoders write 1 (baseline) to a few dozen
#: (progressive: libjpeg's default script has 10, optimised scripts rarely pass 30).
MAX_SCANS = 1000

# Start-of-frame markers of Huffman-coded JPEGs: baseline, extended sequential, progressive.
SOF_HUFFMAN = frozenset((0xC0, 0xC1, 0xC2))
# Every SOFn: DHT (C4), JPG (C8) and DAC (CC) share the range but are not frames.
SOF_ANY = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Progressive SOFn (Huffman, arithmetic; and their differential forms).
_SOF_PROGRESSIVE = frozenset((0xC2, 0xC6, 0xCA, 0xCE))
_SOS, _EOI, _APP14 = 0xDA, 0xD9, 0xEE
# Markers without a length: TEM, RST0-7, SOI, EOI.
_STANDALONE = frozenset((0x01, *range(0xD0, 0xDA)))
# The next marker that ends entropy-coded data: 0xFF then a code that is not 0x00 (a stuffed data byte),
# 0xFF (a fill byte: the marker is the next 0xFF) or RST0-RST7 (restart markers, inside the scan).
_END_OF_DATA = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# Where a marker is due: the same, RST markers included (libjpeg reads and ignores them there).
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xff]")


class Markers(NamedTuple):
    """A JPEG's frames and scans, read from its markers.

    ``height`` and ``width`` are those of the largest frame (by area) of the ``frames`` SOF markers (0x0
    without one); ``scans`` counts the SOS markers before EOI or the end of the data (with
    ``libjpeg``, those libjpeg decodes). ``gpu`` is true when the JPEG has exactly one frame, 8-bit and
    Huffman-coded (baseline, extended or progressive), of 1 or 3 components, with a size, and is not
    Adobe-RGB-coded: what nvImageCodec and nvJPEG decode to RGB.
    """

    height: int
    width: int
    frames: int
    scans: int
    gpu: bool


def walk(data: Data, *, header_only: bool = False, libjpeg: bool = False) -> Markers | None:
    """The markers of ``data``; None if it does not start as a JPEG does (SOI). A JPEG without a frame
    has ``frames`` 0 and a size of 0x0.

    With ``header_only``, stops at the first scan: the first frame's size, and ``scans`` 0 or 1 (for
    bytes already walked in full, where only the size and ``gpu`` are wanted again).

    With ``libjpeg``, counts only the scans libjpeg (Pillow's decoder) decodes: a sequential (not
    progressive) JPEG whose first scan holds every component of its frame is decoded from that scan
    alone (libjpeg refuses a second SOS there, before decoding it), so the walk stops after that scan's
    header, without reading its entropy-coded data: the usual baseline photo costs a few microseconds.
    Progressive JPEGs, and sequential ones whose components come in several scans, are walked in full.
    """
    buf = data if isinstance(data, bytes | bytearray) else memoryview(data).cast("B")  # type: ignore[arg-type]
    n = len(buf)
    if n < 2 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    height = width = frames = scans = components = 0
    gpu = adobe_rgb = progressive = False
    i = 2
    find = _NEXT_MARKER.search
    while True:
        if i + 1 < n and buf[i] == 0xFF and buf[i + 1] not in (0x00, 0xFF):
            marker = buf[i + 1]  # the marker is where it is due: no search (the usual case)
        else:
            found = find(buf, i)
            if found is None:
                break
            i = found.start()
            marker = buf[i + 1]
        i += 2
        if marker in _STANDALONE:
            if marker == _EOI:
                break
            continue
        if i + 2 > n:
            break
        length = (buf[i] << 8) | buf[i + 1]
        if marker in SOF_ANY:
            # length (2), precision (1), height (2), width (2), components (1)
            if i + 8 > n:
                break
            h = (buf[i + 3] << 8) | buf[i + 4]
            w = (buf[i + 5] << 8) | buf[i + 6]
            frames += 1
            if frames == 1:
                components, progressive = buf[i + 7], marker in _SOF_PROGRESSIVE
            if frames == 1 or h * w > height * width:
                height, width = h, w
            gpu = (
                frames == 1
                and marker in SOF_HUFFMAN
                and buf[i + 2] == 8
                and (components == 1 or (components == 3 and not adobe_rgb))
                and h > 0
                and w > 0
            )
        elif marker == _APP14 and length >= 14 and i + 14 <= n and bytes(buf[i + 2 : i + 7]) == b"Adobe":
            adobe_rgb = buf[i + 13] == 0  # transform 0: the components are RGB (or CMYK), not YCbCr
        elif marker == _SOS:
            scans += 1
            if header_only:
                break
            one_pass = libjpeg and scans == 1 and frames == 1 and not progressive
            if one_pass and i + 2 < n and buf[i + 2] == components:
                break  # one interleaved scan of a sequential JPEG: the only one libjpeg decodes
            # The scan's entropy-coded data runs from the end of its header to the next marker.
            found = _END_OF_DATA.search(buf, i + max(length, 2))
            if found is None:
                break
            i = found.start()
            continue
        # A length below 2 is no segment: libjpeg skips what it names (APPn, COM) and reads on; so do we.
        i += max(length, 2)
    return Markers(height, width, frames, scans, gpu)


def check(data: Data, url: str, *, libjpeg: bool = False) -> Markers | None:
    """:func:`walk` of the bytes of ``url``, refusing more than :data:`MAX_SCANS` scans (read now, so
    that a caller who raised it is heard) with a :class:`~blobdata.DecodeError` naming ``url``.
    ``libjpeg``: count the scans libjpeg decodes (for Pillow), as :func:`walk`'s ``libjpeg``."""
    markers = walk(data, libjpeg=libjpeg)
    if markers is not None and markers.scans > MAX_SCANS:
        raise DecodeError(
            f"refused to decode {url}: the JPEG has {markers.scans} scans (SOS markers), more than "
            f"blobdata._decode.jpeg.MAX_SCANS ({MAX_SCANS}); its decoding cost grows with blocks x scans "
            f"({markers.width}x{markers.height} pixels here), a possible scan bomb. Genuine JPEGs have "
            "1 to a few dozen scans: re-encode the image (e.g. as baseline)",
            url=url,
        )
    return markers

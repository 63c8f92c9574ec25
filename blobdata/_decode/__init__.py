"""Bytes to a sample: decoding in the DataLoader worker that fetched them, with a clear error naming
the URL.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``pil``            the default loader (Pillow, from memory), :class:`ObjectFile` for users' loaders
``jpeg``           a JPEG's markers before decoding: every frame's size, the scans (scan bombs refused)
``members``        a sample's members decoded by extension (webdataset's defaults)
=================  ==========================================================================
"""

from __future__ import annotations

from .jpeg import Markers
from .jpeg import check as check_jpeg
from .jpeg import walk as walk_jpeg
from .members import IMAGE_EXTENSIONS, Decoders, Sample, decode_member, decoders_for, extension
from .pil import IMAGE_FORMATS, ObjectFile, decode, decode_with, default_loader, sweep_dead_copies

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_FORMATS",
    "Decoders",
    "Markers",
    "ObjectFile",
    "Sample",
    "check_jpeg",
    "decode",
    "decode_member",
    "decode_with",
    "decoders_for",
    "default_loader",
    "extension",
    "sweep_dead_copies",
    "walk_jpeg",
]

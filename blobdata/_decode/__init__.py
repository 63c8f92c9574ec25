"""Bytes to a sample: decoding in the DataLoader worker that fetched them, with a clear error naming
the URL.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``pil``            the default loader (Pillow, from memory), :class:`ObjectFile` for users' loaders
``jpeg``           a JPEG's markers before decoding: every frame's size, the scans (scan bombs refused)
=================  ==========================================================================
"""

from __future__ import annotations

from .jpeg import Markers
from .jpeg import check as check_jpeg
from .jpeg import walk as walk_jpeg
from .pil import IMAGE_FORMATS, ObjectFile, decode, decode_with, default_loader, sweep_dead_copies

__all__ = [
    "IMAGE_FORMATS",
    "Markers",
    "ObjectFile",
    "check_jpeg",
    "decode",
    "decode_with",
    "default_loader",
    "sweep_dead_copies",
    "walk_jpeg",
]

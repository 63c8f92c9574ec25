"""Bytes to a sample: decoding in the DataLoader worker that fetched them, with a clear error naming
the URL.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``pil``            the default loader (Pillow, from memory), :class:`ObjectFile` for users' loaders
``members``        a sample's members decoded by extension (webdataset's defaults)
=================  ==========================================================================
"""

from __future__ import annotations

from .members import IMAGE_EXTENSIONS, Decoders, decode_member, decoders_for, extension
from .pil import IMAGE_FORMATS, ObjectFile, decode, decode_with, default_loader

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_FORMATS",
    "Decoders",
    "ObjectFile",
    "decode",
    "decode_member",
    "decode_with",
    "decoders_for",
    "default_loader",
    "extension",
]

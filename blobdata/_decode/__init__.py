"""Bytes to a sample: decoding in the DataLoader worker that fetched them, with a clear error naming
the URL.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``pil``            the default loader (Pillow, from memory), :class:`ObjectFile` for users' loaders
=================  ==========================================================================
"""

from __future__ import annotations

from .pil import IMAGE_FORMATS, ObjectFile, decode, decode_with, default_loader

__all__ = ["IMAGE_FORMATS", "ObjectFile", "decode", "decode_with", "default_loader"]

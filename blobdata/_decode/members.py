"""Decoding a sample's members by their extension, with webdataset's defaults.

==============================================  ===========================================
extension (the last one of the object's name)   value
==============================================  ===========================================
``jpg jpeg png webp bmp ppm pgm tif tiff``      RGB ``PIL.Image`` (the default loader: the
                                                same formats and decompression-bomb guard)
``json``                                        parsed (``json.loads``)
``txt text``                                    ``str`` (UTF-8)
``cls cls2 index``                              ``int``
``npy``                                         ``numpy.ndarray``, never unpickled
anything else                                   ``bytes``
==============================================  ===========================================

``decoders={"wav": fn}`` adds or replaces one (``fn(data: bytes) -> value``); a value of ``None``
leaves that extension as bytes; ``decoders=False`` leaves every member as bytes. A failure is a
:class:`~blobdata.DecodeError` naming the object's URL.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import ConfigError, MissingMember
from .pil import IMAGE_EXTENSIONS, decode, default_loader

__all__ = ["IMAGE_EXTENSIONS", "Decoders", "Sample", "decode_member", "decoders_for", "extension"]

Decoder = Callable[[bytes], Any]
Decoders = dict[str, Decoder]


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _npy(data: bytes) -> Any:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _json(data: bytes) -> Any:
    return json.loads(data)


#: Extensions decoded as images by default (and sent to the device on the GPU path).
_IMAGES = IMAGE_EXTENSIONS
_DEFAULTS: Decoders = {
    "json": _json,
    "txt": _text,
    "text": _text,
    "cls": _int,
    "cls2": _int,
    "index": _int,
    "npy": _npy,
}


class Sample(dict[str, Any]):
    """A sample as a dict (``__key__``, ``__url__``, its members, its fields); reading one it does not
    have is a :class:`~blobdata.MissingMember` (a ``KeyError``) naming the sample and what it has."""

    __slots__ = ()

    def __missing__(self, name: str) -> Any:
        have = ", ".join(repr(k) for k in self if k not in ("__key__", "__url__")) or "none"
        raise MissingMember(
            f"sample {self.get('__url__', self.get('__key__'))} has no member {name!r}; it has {have}. "
            "Members are named by extension (x.jpg is 'jpg', x.seg.png is 'seg.png'; a metadata column "
            f"<name>_file_name gives <name>); sample.get({name!r}) reads one that only some samples have",
            url=self.get("__url__"),
        )


def decoders_for(decoders: Mapping[str, Decoder | None] | bool | None) -> Decoders | None:
    """The table for ``decoders=`` (None: every member stays bytes)."""
    if decoders is False:
        return None
    table: Decoders = dict(_DEFAULTS)
    if decoders is None or decoders is True:
        return table
    if not isinstance(decoders, Mapping):
        raise ConfigError(f"decoders must be a mapping of extension to function, or False, got {decoders!r}")
    for ext, fn in decoders.items():
        if not isinstance(ext, str) or not ext or ext.startswith("."):
            raise ConfigError(f"decoders: {ext!r} is not an extension (write 'wav', without the dot)")
        if fn is not None and not callable(fn):
            raise ConfigError(f"decoders[{ext!r}] must be a function of the bytes, got {fn!r}")
        table[ext.lower()] = fn if fn is not None else bytes
    return table


def extension(relkey: str) -> str:
    """The last extension of an object's name, lower-cased (``x.seg.PNG`` -> ``png``)."""
    base = relkey.rpartition("/")[2]
    return base.rpartition(".")[2].lower() if "." in base else ""


def decode_member(data: bytes, url: str, table: Decoders | None) -> Any:
    """The value of one member (see the module docstring)."""
    if table is None:
        return data
    ext = extension(url)
    fn = table.get(ext)
    if fn is None:
        if ext not in _IMAGES:
            return data
        return decode(data, url, default_loader, how="decoders")
    user = fn
    return decode(data, url, lambda _file: user(data), how="decoders")

"""The on-disk form both saved listings share (a :class:`~blobdata.Manifest`, a saved sample table):
a preamble (8-byte magic, format version, header length, CRC-32 of everything after the preamble), a
JSON header that names each array's dtype, offset and length, then the arrays, each 64-byte aligned.
No pickle: a file read back is numbers and ASCII only, and its arrays are views of it (a mapped file
stays mapped)."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from .mapping import Buffer

__all__ = ["PREAMBLE", "pack", "unpack", "write_packed"]

PREAMBLE = struct.Struct("<8sIQI")
ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(
    header: Mapping[str, Any], arrays: Mapping[str, npt.NDArray[Any]], dtypes: Mapping[str, str]
) -> tuple[dict[str, npt.NDArray[Any]], dict[str, dict[str, Any]], bytes, int, int]:
    """The saved form's parts: the arrays as stored, their layout, the JSON header, where the arrays
    start and how many bytes they take (each 64-byte aligned)."""
    flat = {name: np.ascontiguousarray(a, dtype=dtypes[name]) for name, a in arrays.items()}
    layout: dict[str, dict[str, Any]] = {}
    pos = 0
    for name, a in flat.items():
        layout[name] = {"dtype": dtypes[name], "offset": pos, "nbytes": int(a.nbytes)}
        pos += _aligned(a.nbytes)
    head = json.dumps({**header, "arrays": layout}, ensure_ascii=True).encode("ascii")
    return flat, layout, head, _aligned(PREAMBLE.size + len(head)), pos


def pack(
    magic: bytes, version: int, header: Mapping[str, Any], arrays: Mapping[str, npt.NDArray[Any]],
    dtypes: Mapping[str, str],
) -> bytes:  # fmt: skip
    """``header`` (with an ``"arrays"`` layout added) and ``arrays`` (as ``dtypes``) in the saved form."""
    flat, layout, head, start, pos = _layout(header, arrays, dtypes)
    out = bytearray(start + pos)
    out[PREAMBLE.size : PREAMBLE.size + len(head)] = head
    for name, a in flat.items():
        off = start + layout[name]["offset"]
        out[off : off + a.nbytes] = a.data.cast("B")
    crc = zlib.crc32(memoryview(out)[PREAMBLE.size :])
    PREAMBLE.pack_into(out, 0, magic, version, len(head), crc)
    return bytes(out)


_WRITE_BYTES = 8 << 20  # written (and summed) at a time


def write_packed(
    fh: BinaryIO, magic: bytes, version: int, header: Mapping[str, Any],
    arrays: Mapping[str, npt.NDArray[Any]], dtypes: Mapping[str, str],
) -> int:  # fmt: skip
    """:func:`pack`'s bytes written to ``fh`` (at its start, seekable) array by array, never whole in
    memory; returns the CRC-32 it declares."""
    flat, _, head, start, _ = _layout(header, arrays, dtypes)
    fh.write(bytes(PREAMBLE.size))
    first = head + bytes(start - PREAMBLE.size - len(head))
    fh.write(first)
    crc = zlib.crc32(first)
    for a in flat.values():
        view = a.data.cast("B") if a.nbytes else memoryview(b"")
        for lo in range(0, len(view), _WRITE_BYTES):
            chunk = view[lo : lo + _WRITE_BYTES]
            fh.write(chunk)
            crc = zlib.crc32(chunk, crc)
        pad = bytes(_aligned(a.nbytes) - a.nbytes)
        fh.write(pad)
        crc = zlib.crc32(pad, crc)
    fh.seek(0)
    fh.write(PREAMBLE.pack(magic, version, len(head), crc))
    return crc


def unpack(
    data: Buffer,
    *,
    magic: bytes,
    version: int,
    dtypes: Mapping[str, str],
    kind: str,
    verified: bool,
    bad: Callable[[str], Exception],
) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """(header, arrays) of the saved form in ``data``, every part checked against the file's length;
    the arrays are zero-copy views of ``data``. ``kind`` names the form in messages ("manifest");
    ``verified``: the checksum already passed on this node, so it is not computed again;
    ``bad(reason)`` makes the error raised for anything wrong."""
    if len(data) < PREAMBLE.size:
        raise bad(f"only {len(data)} bytes, too short for a {kind}")
    found, found_version, head_len, expected_crc = PREAMBLE.unpack_from(data, 0)
    if found != magic:
        raise bad(f"not a blobdata {kind} (wrong magic bytes)")
    if found_version != version:
        raise bad(f"format version {found_version}, this blobdata reads version {version}")
    if PREAMBLE.size + head_len > len(data):
        raise bad("truncated header")
    if not verified and zlib.crc32(memoryview(data)[PREAMBLE.size :]) != expected_crc:
        raise bad(f"checksum mismatch: the {len(data)}-byte file is corrupt or truncated")
    try:
        header = json.loads(bytes(data[PREAMBLE.size : PREAMBLE.size + head_len]).decode("ascii"))
        layout = header["arrays"]
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"corrupt header ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(header, dict) or not isinstance(layout, dict):
        raise bad("header fields have the wrong types")
    start = _aligned(PREAMBLE.size + head_len)
    arrays: dict[str, npt.NDArray[Any]] = {}
    end = start
    for name, dtype in dtypes.items():
        spec = layout.get(name)
        if not isinstance(spec, dict) or spec.get("dtype") != dtype:
            raise bad(f"array {name!r} missing or of the wrong type")
        off, nbytes = spec.get("offset"), spec.get("nbytes")
        if not isinstance(off, int) or not isinstance(nbytes, int) or off < 0 or nbytes < 0:
            raise bad(f"array {name!r} has an invalid position")
        if start + off + nbytes > len(data):
            raise bad(f"truncated: array {name!r} ends past the end of the {len(data)}-byte file")
        size = np.dtype(dtype).itemsize
        if nbytes % size:
            raise bad(f"array {name!r} has a partial element")
        arrays[name] = np.frombuffer(data, dtype=dtype, count=nbytes // size, offset=start + off)
        end = max(end, start + off + _aligned(nbytes))
    if len(data) != end:
        raise bad(f"{len(data)} bytes where the header describes {end}: truncated or with trailing data")
    return header, arrays

"""A :class:`~blobdata._listing.SampleTable` saved: an index converted once (``blobdata ls URL --index FILE
--save-manifest PATH``), loaded by ``BlobDataset(URL, index=PATH)`` without parsing anything again, and
the bytes rank 0 hands to the other ranks (:func:`blobdata._listing.shared_table`).

The layout is the :class:`~blobdata.Manifest`'s (:mod:`blobdata._listing.manifest`), with its own magic
so that neither is taken for the other, and read without pickle:

====================  =====================================================================
bytes 0-7             magic ``b"BLOBSMPL"``
bytes 8-11            format version, uint32 little endian
bytes 12-19           header length in bytes, uint64 little endian
bytes 20-23           CRC-32 of every byte after the preamble (header, padding, arrays)
header                ASCII JSON: root, samples, objects, where (the template naming an object's
                      line in the index), source, and the offset/length/dtype of each array
arrays                :attr:`SampleTable.ARRAYS`, each at a 64-byte aligned offset
====================  =====================================================================

Everything a table holds is there: sample keys and their member rows, each object's key, size (-1: not
known, learned at its first read), identity (``""``: not known), member name and index line, and each
sample's fields (one JSON text each). A local file is mapped read-only (the node's processes share its
pages) and its checksum verified once per file and node (:mod:`blobdata._listing.mapping`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ManifestError
from .._url import check_relkeys
from .mapping import Buffer, is_verified, makedirs_private, mark_verified, read_source
from .samples import SampleTable

__all__ = [
    "TABLE_MAGIC", "is_table", "load_table", "save_table", "table_from_bytes", "table_to_bytes",
    "write_atomic",
]  # fmt: skip

TABLE_MAGIC = b"BLOBSMPL"
TABLE_VERSION = 1
_PREAMBLE = struct.Struct("<8sIQI")
_ALIGN = 64


def is_table(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a saved table."""
    return head[: len(TABLE_MAGIC)] == TABLE_MAGIC


def table_to_bytes(table: SampleTable, *, source: str = "") -> bytes:
    """The saved form of ``table`` (``source``: what it was made from, kept for messages)."""
    dtypes = SampleTable.ARRAYS
    arrays = {name: np.ascontiguousarray(a, dtype=dtypes[name]) for name, a in table.arrays().items()}
    layout: dict[str, dict[str, Any]] = {}
    pos = 0
    for name, a in arrays.items():
        layout[name] = {"dtype": dtypes[name], "offset": pos, "nbytes": int(a.nbytes)}
        pos += -(-a.nbytes // _ALIGN) * _ALIGN
    header = {
        "format": TABLE_VERSION,
        "root": table.root,
        "samples": len(table),
        "objects": table.num_objects,
        "where": table.where_template,
        "source": source,
        "saved_at": time.time(),
        "arrays": layout,
    }
    head = json.dumps(header, ensure_ascii=True).encode("ascii")
    start = -(-(_PREAMBLE.size + len(head)) // _ALIGN) * _ALIGN
    out = bytearray(start + pos)
    out[_PREAMBLE.size : _PREAMBLE.size + len(head)] = head
    for name, a in arrays.items():
        off = start + layout[name]["offset"]
        out[off : off + a.nbytes] = a.data.cast("B")
    crc = zlib.crc32(memoryview(out)[_PREAMBLE.size :])
    _PREAMBLE.pack_into(out, 0, TABLE_MAGIC, TABLE_VERSION, len(head), crc)
    return bytes(out)


def table_from_bytes(
    data: Buffer, *, source: str, expect_root: str | None = None, verified: bool = False
) -> SampleTable:
    """The table saved in ``data`` (its arrays are views of it); ManifestError naming ``source`` and what
    is wrong (corrupt, truncated, another format or version, another URL than ``expect_root``)."""

    def bad(what: str) -> ManifestError:
        return ManifestError(
            f"saved sample table {source} is unusable: {what}; convert the index again "
            "(blobdata ls URL --index FILE --save-manifest PATH)",
            url=source,
        )

    if len(data) < _PREAMBLE.size:
        raise bad(f"only {len(data)} bytes, too short for a saved table")
    magic, version, head_len, expected_crc = _PREAMBLE.unpack_from(data, 0)
    if magic != TABLE_MAGIC:
        raise bad("not a blobdata sample table (wrong magic bytes)")
    if version != TABLE_VERSION:
        raise bad(f"format version {version}, this blobdata reads version {TABLE_VERSION}")
    if _PREAMBLE.size + head_len > len(data):
        raise bad("truncated header")
    if not verified and zlib.crc32(memoryview(data)[_PREAMBLE.size :]) != expected_crc:
        raise bad(f"checksum mismatch: the {len(data)}-byte file is corrupt or truncated")
    try:
        header = json.loads(bytes(data[_PREAMBLE.size : _PREAMBLE.size + head_len]).decode("ascii"))
        root, where, layout = header["root"], header["where"], header["arrays"]
        samples, objects = header["samples"], header["objects"]
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"corrupt header ({exc.__class__.__name__}: {exc})") from None
    if not (isinstance(root, str) and isinstance(where, str) and isinstance(layout, dict)):
        raise bad("header fields have the wrong types")
    if expect_root is not None and root != expect_root:
        raise ManifestError(
            f"saved sample table {source} is for {root}, not {expect_root}: convert the index for "
            f"{expect_root} (blobdata ls {expect_root} --index FILE --save-manifest PATH) or pass the index",
            url=source,
        )
    start = -(-(_PREAMBLE.size + head_len) // _ALIGN) * _ALIGN
    arrays: dict[str, npt.NDArray[Any]] = {}
    end = start
    for name, dtype in SampleTable.ARRAYS.items():
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
        end = max(end, start + off + -(-nbytes // _ALIGN) * _ALIGN)
    if len(data) != end:
        raise bad(f"{len(data)} bytes where the header describes {end}: truncated or with trailing data")
    if len(arrays["offsets"]) != samples + 1 or len(arrays["sizes"]) != objects:
        raise bad(f"the header says {samples} samples of {objects} objects, the arrays hold others")
    try:
        table = SampleTable.from_arrays(root, arrays, where=where)
    except ValueError as exc:
        raise bad(str(exc)) from None
    if root.startswith("file://"):  # its keys become local paths: none may leave the root
        check_relkeys(arrays["rel"], arrays["rel_off"], root=root)
    return table


def save_table(table: SampleTable, path: str | os.PathLike[str], *, source: str = "") -> None:
    """Write atomically (:func:`write_atomic`)."""
    write_atomic(Path(path).expanduser(), table_to_bytes(table, source=source))


def write_atomic(target: Path, data: bytes) -> None:
    """``data`` as ``target``: a 0600 temporary file in the same directory, fsync, then ``os.replace`` (a
    process mapping the old file keeps it; nobody sees half a file). Missing parents are made 0700."""
    makedirs_private(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load_table(
    source: str, *, storage_options: Mapping[str, Any] | None = None, expect_root: str | None = None,
    data: Buffer | None = None,
) -> SampleTable:  # fmt: skip
    """The table saved at ``source`` (a local path, mapped; or a URL), or in ``data`` already read."""
    mark = None
    if data is None:
        data, mark = read_source(source, storage_options, False)
    known = is_verified(mark)
    table = table_from_bytes(data, source=source, expect_root=expect_root, verified=known)
    if not known:
        mark_verified(mark)
    return table

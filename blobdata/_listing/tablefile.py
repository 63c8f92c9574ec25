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

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import ManifestError
from .._url import check_relkeys
from .mapping import Buffer, is_verified, mark_verified, read_source, write_atomic
from .packed import pack, unpack
from .samples import SampleTable

__all__ = [
    "TABLE_MAGIC", "is_table", "load_table", "save_table", "table_from_bytes", "table_to_bytes",
]  # fmt: skip

TABLE_MAGIC = b"BLOBSMPL"
TABLE_VERSION = 1


def is_table(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a saved table."""
    return head[: len(TABLE_MAGIC)] == TABLE_MAGIC


def table_to_bytes(table: SampleTable, *, source: str = "") -> bytes:
    """The saved form of ``table`` (``source``: what it was made from, kept for messages)."""
    header = {
        "format": TABLE_VERSION,
        "root": table.root,
        "samples": len(table),
        "objects": table.num_objects,
        "where": table.where_template,
        "source": source,
        "saved_at": time.time(),
    }
    return pack(TABLE_MAGIC, TABLE_VERSION, header, table.arrays(), SampleTable.ARRAYS)


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

    header, arrays = unpack(
        data, magic=TABLE_MAGIC, version=TABLE_VERSION, dtypes=SampleTable.ARRAYS, kind="sample table",
        verified=verified, bad=bad,
    )  # fmt: skip
    try:
        root, where = header["root"], header["where"]
        samples, objects = header["samples"], header["objects"]
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"corrupt header ({exc.__class__.__name__}: {exc})") from None
    if not (isinstance(root, str) and isinstance(where, str)):
        raise bad("header fields have the wrong types")
    if expect_root is not None and root != expect_root:
        raise ManifestError(
            f"saved sample table {source} is for {root}, not {expect_root}: convert the index for "
            f"{expect_root} (blobdata ls {expect_root} --index FILE --save-manifest PATH) or pass the index",
            url=source,
        )
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


def load_table(
    source: str, *, storage_options: Mapping[str, Any] | None = None, expect_root: str | None = None,
    data: Buffer | None = None, own: str | None = None,
) -> SampleTable:  # fmt: skip
    """The table saved at ``source`` (a local path, mapped; or a URL), or in ``data`` already read;
    ``own``: a file of a place shared on the node (see :func:`~blobdata._listing.mapping.read_source`)."""
    mark = None
    if data is None:
        data, mark = read_source(source, storage_options, False, own=own)
    known = is_verified(mark)
    table = table_from_bytes(data, source=source, expect_root=expect_root, verified=known)
    if not known:
        mark_verified(mark)
    return table

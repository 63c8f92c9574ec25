"""Rows of a Parquet file, read row group by row group and a batch of rows at a time, each bounded.

A Parquet file is small on disk and large in memory by design: a dictionary page holds a value once and
a run-length page repeats it a million times, so an 810-byte file can name a million rows of a 100-byte
key. Reading it whole (``read_table().to_pylist()``) would cost what it inflates to before its first row
is seen. Here, what one read may inflate to is bounded before it is made:

* a row group whose column chunks declare more than :data:`ROW_GROUP_BYTES` uncompressed is refused
  (its pages would be decompressed into that much);
* rows are read :data:`BATCH_ROWS` at a time with text and binary columns kept as dictionaries, and a
  batch whose values would expand to more than :data:`BATCH_BYTES` as Python objects is refused before
  they are made.

Memory is then one row group's pages and one batch, whatever the number of rows; errors name the file
and the rows. The source is bytes already read, or a seekable file (a local file, or an object read
in ranges: :func:`~blobdata._listing.tables.open_bytes`). Needs ``pyarrow``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any, BinaryIO

from .._errors import ConfigError

__all__ = ["BATCH_BYTES", "BATCH_ROWS", "ROW_GROUP_BYTES", "parquet_rows"]

#: The most bytes one row group's column chunks may declare, uncompressed.
ROW_GROUP_BYTES = 1 << 30
#: Rows decoded at once.
BATCH_ROWS = 4096
#: The most one batch of rows may expand to as Python values (payload plus a per-value overhead).
BATCH_BYTES = 64 << 20
_PER_VALUE = 64  # bytes a Python value costs beyond its payload, roughly


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _pyarrow(source: str, what: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{what} {source} is a Parquet file, and reading Parquet needs pyarrow: pip install pyarrow "
            "(or give the table as CSV or JSON Lines)",
            url=source,
        ) from None
    return pq


def _expanded(array: Any) -> int:
    """Bytes ``array``'s values would take as Python objects (dictionaries counted as expanded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.ChunkedArray):
        return sum(_expanded(c) for c in array.chunks)
    kind = array.type
    if pa.types.is_dictionary(kind):
        lengths = pc.binary_length(array.dictionary) if _is_text(kind.value_type) else None
        payload = 0 if lengths is None else int(pc.sum(pc.take(lengths, array.indices)).as_py() or 0)
        return payload + _PER_VALUE * len(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _expanded(array.flatten()) + _PER_VALUE * len(array)
    if pa.types.is_struct(kind):
        return sum(_expanded(f) for f in array.flatten()) + _PER_VALUE * len(array)
    if pa.types.is_map(kind):
        return _expanded(array.keys) + _expanded(array.items) + _PER_VALUE * len(array)
    return int(array.nbytes) + _PER_VALUE * len(array)


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind))  # fmt: skip


def parquet_rows(source: str, data: bytes | BinaryIO, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of the Parquet file ``source`` (``data``: its bytes or a seekable file of
    them), ``n`` counted from 1; ConfigError naming the file (and the rows) for an unreadable file or a
    row group or batch over the bounds (see the module)."""
    pq = _pyarrow(source, what)
    fh = io.BytesIO(data) if isinstance(data, bytes) else data
    name = f"{what} {source}"
    try:
        meta = pq.ParquetFile(fh).metadata
        # Text and binary columns, nested ones too, are read as dictionaries: a value repeated by a run is
        # held once until it is measured.
        columns = [meta.schema.column(i) for i in range(meta.num_columns)]
        texts = [c.path for c in columns if c.physical_type in ("BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")]
        fh.seek(0)
        pf = pq.ParquetFile(fh, read_dictionary=texts, buffer_size=1 << 20)
    except Exception as exc:
        raise ConfigError(f"{name} is not a readable Parquet file: {exc}", url=source) from None
    n = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        declared = sum(max(0, group.column(c).total_uncompressed_size) for c in range(group.num_columns))
        if declared > ROW_GROUP_BYTES:
            raise ConfigError(
                f"{name} row group {g} (rows {n + 1} to {n + group.num_rows}) declares "
                f"{_mib(declared)} uncompressed, more than the {_mib(ROW_GROUP_BYTES)} blobdata "
                "reads at once: write it with smaller row groups (pyarrow: row_group_size=)",
                url=source,
            )
        try:
            batches = pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], use_threads=False)
            for batch in batches:
                size = sum(_expanded(c) for c in batch.columns)
                if size > BATCH_BYTES:
                    raise ConfigError(
                        f"{name} rows {n + 1} to {n + batch.num_rows} would take {_mib(size)} in "
                        f"memory (more than {_mib(BATCH_BYTES)} for {BATCH_ROWS} rows): its values are "
                        "too large for an index or metadata file",
                        url=source,
                    )
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{name} row group {g} is not readable: {exc}", url=source) from None

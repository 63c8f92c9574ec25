"""Rows of a Parquet file, read row group by row group and a batch of rows at a time, each bounded.

A Parquet file is small on disk and large in memory by design: a dictionary page holds a value once and
a run-length page repeats it a million times, so an 810-byte file can name a million rows of a 100-byte
key. Reading it whole (``read_table().to_pylist()``) would cost what it inflates to before its first row
is seen. Here, what one read may inflate to is bounded before it is made:

* a row group whose column chunks declare more than :data:`ROW_GROUP_BYTES` uncompressed is refused
  (its pages would be decompressed into that much);
* a row group is read with its text and binary columns kept as dictionaries (a run of one value is
  that value once and an index per row), then made into rows :data:`BATCH_ROWS` at a time; a batch
  whose values would expand to more than :data:`BATCH_BYTES` as Python objects is refused before they
  are made.

Memory is then one row group, as compact as the file's own encoding (4 bytes a row for a text column,
plus its distinct values), and one batch of rows, whatever the number of rows; errors name the file and
the rows. Not checked: a page whose own header declares a larger size than the column chunk does
(pyarrow decompresses a page into what its header declares). The source is bytes already read, or a
seekable file (a local file, or an object read in ranges: :func:`~blobdata._tables.read.open_bytes`).
Needs ``pyarrow``.
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


def _range_sums(values: Any, bounds: Any) -> Any:
    """The sums of ``values`` (a numpy array) over ``[bounds[i], bounds[i + 1])``, as int64."""
    import numpy as np

    out = np.zeros(len(bounds) - 1, dtype=np.int64)
    lo, hi = int(bounds[0]), int(bounds[-1])
    if hi <= lo:
        return out
    starts = bounds[:-1] - lo
    nonempty = bounds[1:] > bounds[:-1]
    out[nonempty] = np.add.reduceat(values[lo:hi], starts[nonempty], dtype=np.int64)
    return out


def _sizes(array: Any, bounds: Any) -> Any:
    """Bytes the rows ``[bounds[i], bounds[i + 1])`` of ``array`` (one chunk) would take as Python
    objects: the values' payload (a dictionary's value counted once per row that names it) and
    :data:`_PER_VALUE` per value. Vectorised over the whole row group, and never a Python value made."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    values = np.diff(bounds) * _PER_VALUE
    if pa.types.is_dictionary(kind):
        if not _is_text(kind.value_type):
            return values
        lengths = pc.take(pc.binary_length(array.dictionary), array.indices).fill_null(0)
        return values + _range_sums(np.asarray(lengths), bounds)
    if _is_text(kind):
        return values + _range_sums(np.asarray(pc.binary_length(array).fill_null(0)), bounds)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        offsets = np.asarray(array.offsets, dtype=np.int64)
        return values + _sizes(array.values, offsets[bounds])
    if pa.types.is_fixed_size_list(kind):
        return values + _sizes(array.values, (bounds + array.offset) * kind.list_size)
    if pa.types.is_struct(kind):
        for i in range(kind.num_fields):
            values = values + _sizes(array.field(i), bounds)
        return values
    try:
        width = max(1, kind.bit_width // 8)
    except ValueError:  # no fixed width (decimal text, extension types): its buffers, shared out
        width = -(-int(array.nbytes) // max(1, len(array)))
    return values + np.diff(bounds) * width


def _batch_sizes(table: Any, rows: int) -> Any:
    """Bytes each batch of :data:`BATCH_ROWS` rows of ``table`` (a row group) would take as Python
    objects (a numpy array, one per batch)."""
    import numpy as np

    bounds = np.append(np.arange(0, rows, BATCH_ROWS, dtype=np.int64), np.int64(rows))
    total = np.zeros(len(bounds) - 1, dtype=np.int64)
    for column in table.columns:
        total += _sizes(column.combine_chunks(), bounds)
    return total


def _plain_type(kind: Any) -> Any:
    """``kind`` with every dictionary replaced by its value type (what the rows are decoded as)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        return kind.value_type
    if pa.types.is_list(kind):
        return pa.list_(_plain_type(kind.value_type))
    if pa.types.is_large_list(kind):
        return pa.large_list(_plain_type(kind.value_type))
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_plain_type(f.type)) for f in kind])
    return kind


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                or pa.types.is_large_binary(kind))  # fmt: skip


def parquet_rows(source: str, data: bytes | BinaryIO, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of the Parquet file ``source`` (``data``: its bytes or a seekable file of
    them), ``n`` counted from 1; ConfigError naming the file (and the rows) for an unreadable file or a
    row group or batch over the bounds (see the module)."""
    pq = _pyarrow(source, what)
    import pyarrow as pa

    fh = io.BytesIO(data) if isinstance(data, bytes) else data
    name = f"{what} {source}"
    try:
        meta = pq.ParquetFile(fh).metadata
        # Text and binary columns, nested ones too, are read as dictionaries: a value repeated by a run is
        # held once until it is measured.
        columns = [meta.schema.column(i) for i in range(meta.num_columns)]
        texts = [c.path for c in columns if c.physical_type in ("BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY")]
        fh.seek(0)
        pf = pq.ParquetFile(fh, read_dictionary=texts)
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
            # The whole row group, its text kept as dictionaries (compact however repetitive: a run of one
            # value is its index repeated); then rows decoded a batch at a time, each measured first.
            table = pf.read_row_group(g, use_threads=False)
            plain = pa.schema([f.with_type(_plain_type(f.type)) for f in table.schema])
            sizes = _batch_sizes(table, table.num_rows)
            for b, start in enumerate(range(0, table.num_rows, BATCH_ROWS)):
                batch = table.slice(start, BATCH_ROWS)
                size = int(sizes[b])
                if size > BATCH_BYTES:
                    raise ConfigError(
                        f"{name} rows {n + 1} to {n + batch.num_rows} would take {_mib(size)} in "
                        f"memory (more than {_mib(BATCH_BYTES)} for {BATCH_ROWS} rows): its values are "
                        "too large for an index or metadata file",
                        url=source,
                    )
                for row in batch.cast(plain).to_pylist():
                    n += 1
                    yield n, row
            del table
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{name} row group {g} is not readable: {exc}", url=source) from None

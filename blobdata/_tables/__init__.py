"""Table files (CSV, JSON Lines, Parquet), local or in a bucket: their rows read with the file and line
every error names, their columns typed as the conventions' owners type them, a large one read in bounded
memory.

============  ==============================================================================
module        its one job
============  ==============================================================================
``read``      the rows of a table file, each with where it was read; a large one streamed
``columns``   columns typed as their owners type them (CSV as pandas, JSON Lines as pyarrow)
``parquet``   a Parquet file's rows, row group by row group, each batch bounded before it is made
============  ==============================================================================
"""

from __future__ import annotations

from .columns import MAX_DEPTH, depth, type_csv, type_jsonl
from .read import FORMATS, format_of, open_bytes, place, read_bytes, resolve, rows

__all__ = [
    "FORMATS",
    "MAX_DEPTH",
    "depth",
    "format_of",
    "open_bytes",
    "place",
    "read_bytes",
    "resolve",
    "rows",
    "type_csv",
    "type_jsonl",
]

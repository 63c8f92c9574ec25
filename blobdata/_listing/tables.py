"""Rows of a table file (CSV, JSON Lines, Parquet), local or in a bucket, each with where it was read
(``"metadata.csv line 3"``) so that an error can name the file and the line.

A CSV column is typed as a whole, as pandas reads it for Hugging Face, and a JSON Lines column as
pyarrow reads it (:mod:`blobdata._listing.columns`). Parquet needs ``pyarrow`` (``pip install pyarrow``);
CSV and JSON Lines need nothing.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError, NotFound
from .._url import parse_url
from .columns import MAX_DEPTH, depth, type_csv, type_jsonl

__all__ = ["FORMATS", "format_of", "place", "read_bytes", "resolve", "rows"]

FORMATS = ("csv", "jsonl", "parquet")


def format_of(source: str) -> str:
    """``csv``, ``jsonl`` or ``parquet``, from the name (``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``)."""
    name = source.lower().rstrip("/")
    for ext, fmt in ((".csv", "csv"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".parquet", "parquet")):
        if name.endswith(ext):
            return fmt
    raise ConfigError(
        f"{source}: cannot tell the format from the name: use a .csv, .jsonl or .parquet file", url=source
    )


def read_bytes(source: str, storage_options: Mapping[str, Any] | None, *, what: str) -> bytes:
    """The bytes of a local file or of an object (``what`` names it in errors: "index", "metadata")."""
    if "://" not in source or source.startswith("file://"):
        path = source[len("file://") :] if source.startswith("file://") else source
        try:
            return Path(path).expanduser().read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{what} file {source} does not exist", url=source) from None
        except OSError as exc:
            raise ConfigError(
                f"{what} file {source} cannot be read: {exc.strerror or exc}", url=source
            ) from exc
    from .._config import FetchOptions
    from .._fetch import FetchEngine
    from .._loop import run
    from .._stores import resolve_storage_options

    url = parse_url(source)
    # One GET through blobdata's own reader (its retry budget and error map), no HEAD before it.
    engine = FetchEngine(
        FetchOptions(),
        url.protocol,
        resolve_storage_options(url.protocol, storage_options or {}),
        root=source,
    )

    async def fetch() -> bytes:
        try:
            return (await engine.fetch(source))[0]
        finally:
            await engine.aclose()

    try:
        return run(fetch())
    except NotFound as exc:
        raise NotFound(f"{what} file {source} does not exist ({exc.message})", url=source) from exc


def place(source: str, fmt: str, what: str) -> str:
    """Where a row of ``source`` is, as a template of its number: ``"index x.csv line {}"``."""
    return f"{what} {source} {'row' if fmt == 'parquet' else 'line'} {{}}"


def rows(
    source: str, data: bytes, fmt: str, *, what: str, keep: Container[str] = frozenset()
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of ``data`` (the bytes of ``source``), ``n`` its line (its row number
    in Parquet; :func:`place` names it); columns in ``keep`` are not typed (CSV: text as read)."""
    name = f"{what} {source}"
    if fmt == "jsonl":
        yield from _jsonl(name, source, data, keep)
    elif fmt == "csv":
        yield from _csv(name, source, data, keep)
    elif fmt == "parquet":
        yield from enumerate(_parquet(source, data, what), 1)
    else:
        raise ConfigError(f"unknown table format {fmt!r} for {source}", url=source)


def _jsonl(name: str, source: str, data: bytes, keep: Container[str]) -> list[tuple[int, dict[str, Any]]]:
    out: list[tuple[int, dict[str, Any]]] = []
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        deep = False
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(
                f"{name} line {n} is not valid JSON ({exc}): fix or remove it", url=source
            ) from None
        except RecursionError:
            row, deep = {}, True  # said below, as any value nested too deeply
        if not isinstance(row, dict):
            raise ConfigError(f"{name} line {n} is not a JSON object but {type(row).__name__}", url=source)
        # (a value nested deeper than MAX_DEPTH takes more than 2 * MAX_DEPTH characters)
        if deep or (len(line) > 2 * MAX_DEPTH and depth(row) > MAX_DEPTH):
            raise ConfigError(
                f"{name} line {n} nests lists or objects more than {MAX_DEPTH} levels deep: flatten it, or "
                "keep such a value in a member file (x.json) of its sample",
                url=source,
            )
        out.append((n, row))
    type_jsonl([row for _, row in out], keep)
    return out


def _csv(name: str, source: str, data: bytes, keep: Container[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name} is not UTF-8 text ({exc})", url=source) from None
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if not header:
            return
        header = _unique([h.strip() for h in header])
        width = len(header)
        lines: list[int] = []
        cells: list[list[str]] = []
        start = reader.line_num + 1  # where the next record starts, for an error in it
        for values in reader:
            n = reader.line_num
            start = n + 1
            if len(values) != width or width == 1:
                if len(values) <= 1 and (not values or not values[0].strip()):
                    continue  # a blank line, skipped as pandas skips it
                if len(values) > width:
                    raise ConfigError(
                        f"{name} line {n} has {len(values)} values where the header names {width} columns",
                        url=source,
                    )
                values += [""] * (width - len(values))  # missing values are missing, as pandas reads them
            lines.append(n)
            cells.append(values)
    except csv.Error as exc:
        limit = csv.field_size_limit()
        why = f"a value longer than {limit // 1024} KiB" if "field larger" in str(exc) else str(exc)
        raise ConfigError(
            f"{name} line {start} cannot be read as CSV ({why}): keep long text in a member "
            "file (x.txt) of its sample, or give the table as JSON Lines or Parquet",
            url=source,
        ) from None
    columns = type_csv(header, cells, keep)
    for n, typed in zip(lines, zip(*columns, strict=True), strict=True):
        yield n, dict(zip(header, typed, strict=True))


def _unique(header: list[str]) -> list[str]:
    """Column names made unique as pandas makes them: a second ``a`` is ``a.1`` (or ``a.2`` when there
    is an ``a.1``), and an empty name ``Unnamed: <its position>``."""
    names = [h or f"Unnamed: {j}" for j, h in enumerate(header)]
    taken = set(names)
    seen: set[str] = set()
    out = []
    for h in names:
        if h in seen:
            k = 1
            while f"{h}.{k}" in taken:
                k += 1
            h = f"{h}.{k}"
            taken.add(h)
        seen.add(h)
        out.append(h)
    return out


def _parquet(source: str, data: bytes, what: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{what} {source} is a Parquet file, and reading Parquet needs pyarrow: pip install pyarrow "
            "(or give the table as CSV or JSON Lines)",
            url=source,
        ) from None
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as exc:
        raise ConfigError(f"{what} {source} is not a readable Parquet file: {exc}", url=source) from None
    out: list[dict[str, Any]] = table.to_pylist()
    return out


def resolve(source: str, root: str) -> str:
    """``source`` as given when it is a URL or an existing local path, else relative to ``root``."""
    if "://" in source or os.path.isabs(source) or os.path.exists(source):
        return source
    return root.rstrip("/") + "/" + source

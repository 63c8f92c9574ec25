"""Rows of a table file (CSV, JSON Lines, Parquet), local or in a bucket, each with where it was read
(``"metadata.csv line 3"``) so that an error can name the file and the line.

A CSV column is typed as a whole, as pandas reads it for Hugging Face, and a JSON Lines column as
pyarrow reads it (:mod:`blobdata._tables.columns`). Parquet needs ``pyarrow`` (``pip install
pyarrow``); CSV and JSON Lines need nothing.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._errors import ConfigError, NotFound
from .._url import parse_url
from .columns import MAX_DEPTH, depth, type_csv, type_jsonl

if TYPE_CHECKING:
    from .._fetch import FetchEngine

__all__ = ["FORMATS", "format_of", "open_bytes", "place", "read_bytes", "resolve", "rows"]

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


def _local(source: str) -> str | None:
    """The local path ``source`` names, or None for an object URL."""
    if "://" not in source or source.startswith("file://"):
        return source[len("file://") :] if source.startswith("file://") else source
    return None


def _engine(source: str, storage_options: Mapping[str, Any] | None) -> FetchEngine:
    from .._config import FetchOptions
    from .._fetch import FetchEngine
    from .._stores import resolve_storage_options

    url = parse_url(source)
    options = resolve_storage_options(url.protocol, storage_options or {})
    return FetchEngine(FetchOptions(), url.protocol, options, root=source)


@contextlib.contextmanager
def _local_errors(source: str, what: str) -> Iterator[None]:
    """A local table file's OSError as blobdata's: NotFound, else a ConfigError with the reason."""
    try:
        yield
    except FileNotFoundError:
        raise NotFound(f"{what} file {source} does not exist", url=source) from None
    except OSError as exc:
        raise ConfigError(f"{what} file {source} cannot be read: {exc.strerror or exc}", url=source) from exc


def read_bytes(source: str, storage_options: Mapping[str, Any] | None, *, what: str) -> bytes:
    """The bytes of a local file or of an object (``what`` names it in errors: "index", "metadata")."""
    path = _local(source)
    if path is not None:
        with _local_errors(source, what):
            return Path(path).expanduser().read_bytes()
    from .._loop import run

    # One GET through blobdata's own reader (its retry budget and error map), no HEAD before it.
    engine = _engine(source, storage_options)

    async def fetch() -> bytes:
        try:
            return (await engine.fetch(source))[0]
        finally:
            await engine.aclose()

    try:
        return run(fetch())
    except NotFound as exc:
        raise NotFound(f"{what} file {source} does not exist ({exc.message})", url=source) from exc


@contextlib.contextmanager
def open_bytes(source: str, storage_options: Mapping[str, Any] | None, *, what: str) -> Iterator[BinaryIO]:
    """A local file, or an object read in ranges as it is consumed (:class:`~blobdata._fetch.RangedFile`),
    as a seekable binary file: what reads a large table holds a range of it, not all of it."""
    path = _local(source)
    if path is not None:
        with _local_errors(source, what):
            fh: BinaryIO = open(os.path.expanduser(path), "rb")  # noqa: SIM115 (closed below)
        with fh:
            yield fh
        return
    from .._fetch import RangedFile
    from .._loop import run

    engine = _engine(source, storage_options)
    try:
        yield io.BufferedReader(RangedFile(engine, source), buffer_size=1 << 20)  # type: ignore[arg-type]
    except NotFound as exc:
        if exc.url != source:
            raise
        raise NotFound(f"{what} file {source} does not exist ({exc.message})", url=source) from exc
    finally:
        run(engine.aclose())


def place(source: str, fmt: str, what: str) -> str:
    """Where a row of ``source`` is, as a template of its number: ``"index x.csv line {}"``."""
    return f"{what} {source} {'row' if fmt == 'parquet' else 'line'} {{}}"


def rows(
    source: str, data: bytes | BinaryIO, fmt: str, *, what: str, keep: Container[str] = frozenset()
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of ``data`` (the bytes of ``source``; for Parquet, or a seekable file of
    them: :func:`open_bytes`), ``n`` its line (its row number in Parquet; :func:`place` names it); columns
    in ``keep`` are not typed (CSV: text as read). Parquet is read row group by row group, a batch of rows
    at a time, each bounded (:mod:`blobdata._tables.parquet`)."""
    if fmt == "parquet":
        from .parquet import parquet_rows

        yield from parquet_rows(source, data, what)
        return
    if not isinstance(data, bytes):
        data = data.read()
    name = f"{what} {source}"
    if fmt == "jsonl":
        yield from _jsonl(name, source, data, keep)
    elif fmt == "csv":
        yield from _csv(name, source, data, keep)
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


def resolve(source: str, root: str) -> str:
    """``source`` as given when it is a URL or an existing local path, else relative to ``root``."""
    if "://" in source or os.path.isabs(source) or os.path.exists(source):
        return source
    return root.rstrip("/") + "/" + source

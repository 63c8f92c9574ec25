"""Rows of a table file (CSV, JSON Lines, Parquet), local or in a bucket, each with where it was read
(``"metadata.csv line 3"``) so that an error can name the file and the line.

CSV values are text, read as numbers where they are numbers (``"3"`` is ``3``, ``"0.5"`` is ``0.5``) and
as nothing where empty, as pandas reads them for Hugging Face. Parquet needs ``pyarrow``
(``pip install pyarrow``); CSV and JSON Lines need nothing.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .._errors import ConfigError, NotFound
from .._url import parse_url

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


def read_bytes(source: str, storage_options: Mapping[str, Any] | None, *, what: str) -> bytes:
    """The bytes of a local file or of an object (``what`` names it in errors: "index", "metadata")."""
    path = _local(source)
    if path is not None:
        try:
            return Path(path).expanduser().read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{what} file {source} does not exist", url=source) from None
        except OSError as exc:
            raise ConfigError(
                f"{what} file {source} cannot be read: {exc.strerror or exc}", url=source
            ) from exc
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
        try:
            fh: BinaryIO = open(os.path.expanduser(path), "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise NotFound(f"{what} file {source} does not exist", url=source) from None
        except OSError as exc:
            raise ConfigError(
                f"{what} file {source} cannot be read: {exc.strerror or exc}", url=source
            ) from exc
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


_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def _number(text: str) -> Any:
    if text == "":
        return None
    if _NUMBER.fullmatch(text) is None:
        return text
    return int(text) if text.lstrip("+-").isdigit() else float(text)


def place(source: str, fmt: str, what: str) -> str:
    """Where a row of ``source`` is, as a template of its number: ``"index x.csv line {}"``."""
    return f"{what} {source} {'row' if fmt == 'parquet' else 'line'} {{}}"


def rows(
    source: str, data: bytes | BinaryIO, fmt: str, *, what: str, keep: frozenset[str] = frozenset()
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of ``data`` (the bytes of ``source``; for Parquet, or a seekable file of
    them: :func:`open_bytes`), ``n`` its line (its row number in Parquet; :func:`place` names it); CSV
    columns in ``keep`` stay text (no number read from them). Parquet is read row group by row group, a
    batch of rows at a time, each bounded (:mod:`blobdata._listing.parquet`)."""
    if fmt == "parquet":
        from .parquet import parquet_rows

        yield from parquet_rows(source, data, what)
        return
    if not isinstance(data, bytes):
        data = data.read()
    name = f"{what} {source}"
    if fmt == "jsonl":
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(
                    f"{name} line {n} is not valid JSON ({exc}): fix or remove it", url=source
                ) from None
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{name} line {n} is not a JSON object but {type(row).__name__}", url=source
                )
            yield n, row
    elif fmt == "csv":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{name} is not UTF-8 text ({exc})", url=source) from None
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if not header:
            return
        header = [h.strip() for h in header]
        for values in reader:
            if not values or values == [""]:
                continue
            if len(values) != len(header):
                raise ConfigError(
                    f"{name} line {reader.line_num} has {len(values)} values where the header names "
                    f"{len(header)} columns",
                    url=source,
                )
            yield (
                reader.line_num,
                {h: v if h in keep else _number(v) for h, v in zip(header, values, strict=True)},
            )
    else:
        raise ConfigError(f"unknown table format {fmt!r} for {source}", url=source)


def resolve(source: str, root: str) -> str:
    """``source`` as given when it is a URL or an existing local path, else relative to ``root``."""
    if "://" in source or os.path.isabs(source) or os.path.exists(source):
        return source
    return root.rstrip("/") + "/" + source

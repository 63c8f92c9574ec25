"""Rows of a table file (CSV, JSON Lines, Parquet), local or in a bucket, each with where it was read
(``"metadata.csv line 3"``) so that an error can name the file and the line.

CSV values are text, read as numbers where they are numbers (``"3"`` is ``3``, ``"0.5"`` is ``0.5``) and
as nothing where empty, as pandas reads them for Hugging Face. Parquet needs ``pyarrow``
(``pip install pyarrow``); CSV and JSON Lines need nothing.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError, NotFound
from .._url import parse_url

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
    source: str, data: bytes, fmt: str, *, what: str, keep: frozenset[str] = frozenset()
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(n, row)`` for every row of ``data`` (the bytes of ``source``), ``n`` its line (its row number
    in Parquet; :func:`place` names it); CSV columns in ``keep`` stay text (no number read from them)."""
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
    elif fmt == "parquet":
        yield from enumerate(_parquet(source, data, what), 1)
    else:
        raise ConfigError(f"unknown table format {fmt!r} for {source}", url=source)


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

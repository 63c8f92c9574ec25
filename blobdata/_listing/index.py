"""Index files instead of a listing: the objects of a dataset named by a table the user already has.

A CSV, JSON Lines or Parquet file with a ``key`` column (relative to the dataset's URL, or a URL below
it) and optional ``size`` (bytes), ``etag`` (quotes optional) and ``version_id`` columns; every other
column is a field of the row's sample. Rows are grouped into samples by webdataset's key rule. Or an S3
Inventory report: its ``manifest.json`` (local or a URL) and the CSV (gzipped, columns named by
``fileSchema``, keys URL-encoded) or Parquet files it lists in its destination bucket; the rows of the
dataset's bucket below its prefix are kept, and of a report of all versions (``IsLatest`` and
``IsDeleteMarker`` columns) only the current versions that are not delete markers, the objects a
listing shows. No listing request is made either way.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, BinaryIO

from .._errors import ConfigError
from .._stores import listed_size
from .._tables import format_of, open_bytes, place, read_bytes, rows
from .._url import parse_url
from .samples import Member, relative_key, same_member, split_key

__all__ = ["read_index"]

Sample = tuple[str, list[Member], dict[str, Any]]
_KNOWN = frozenset({"key", "size", "etag", "version_id"})
# What may make a key not a plain relative one (a URL, '..', '//', '/./', a leading '/' or '.', a trailing
# '/' or '/.', NUL, a backslash): such keys take relative_key's full check.
_SUSPECT = re.compile(r"://|\.\.|//|/\./|[\x00\\]|^[/.]|/\.?$")


def read_index(
    root: str, index: str, *, storage_options: Mapping[str, Any], data: bytes | None = None
) -> tuple[list[Sample], str]:
    """The samples an index names (see the module docstring), sorted by key, and the template that names
    a member's row (``"index x.csv line {}"``); ``data``: the index's bytes, when already read."""
    if index.rstrip("/").endswith("manifest.json"):
        found: Iterable[tuple[int, dict[str, Any]]] = _inventory(root, index, storage_options)
        tmpl = f"S3 Inventory {index} row {{}}"
    else:
        if data is None:
            data = read_bytes(index, storage_options, what="index")
        fmt = format_of(index)
        found = rows(index, data, fmt, what="index", keep=_KNOWN)
        tmpl = place(index, fmt, "index")
    return _group(root, index, found, tmpl), tmpl


def _group(root: str, index: str, found: Iterable[tuple[int, dict[str, Any]]], tmpl: str) -> list[Sample]:
    groups: dict[str, tuple[list[Member], dict[str, Any], dict[str, int]]] = {}
    columns: dict[str, None] = {}  # the fields' columns, each in every sample (None where no row gave it)
    for n, row in found:
        value = row.get("key")
        if isinstance(value, str) and value and _SUSPECT.search(value) is None:
            rel = value  # a plain relative key (the common case, checked with one search)
        elif "key" not in row:
            raise ConfigError(
                f"{_Where(tmpl, n)} has no 'key' column: an index names each object in a key column",
                url=index,
            )
        else:
            rel = relative_key(value, root, _Where(tmpl, n), "key")
        size = -1
        given = row.get("size")
        if isinstance(given, str) and given.isdigit() and len(given) < 16:
            size = int(given)
        elif given not in (None, ""):
            try:
                size = listed_size(given, f"{root}/{rel}")
            except Exception:
                raise ConfigError(
                    f"{_Where(tmpl, n)}: size {row['size']!r} of {root}/{rel} is not a whole number of bytes",
                    url=index,
                ) from None
        etag = row.get("etag")
        identity = str(etag).strip().strip('"') if etag else ""
        version = row.get("version_id")
        if version and identity and str(version).strip() not in ("", "null"):
            identity = f"{identity}@{str(version).strip()}"
        split = split_key(rel)
        if split is None:
            raise ConfigError(
                f"{_Where(tmpl, n)}: {rel!r} has no extension, so it belongs to no sample (a sample's key is "
                "the name up to its first dot, and the member's name the rest)",
                url=index,
            )
        key, name = split
        group = groups.get(key)
        if group is None:
            group = groups[key] = ([], {}, {})
        members, fields, origin = group
        members.append(Member(rel, size, identity, name, n))
        if row.keys() <= _KNOWN:
            continue
        for column, value in row.items():
            if column in _KNOWN:
                continue
            if value is None:  # an empty cell says nothing
                if column not in columns:
                    columns[column] = None
                continue
            if column in fields and fields[column] != value:
                raise ConfigError(
                    f"{_Where(tmpl, n)} gives {column}={value!r} for sample {key!r}, and "
                    f"{tmpl.format(origin[column])} gave {fields[column]!r}: rows of one sample must agree",
                    url=index,
                )
            fields[column], origin[column] = value, n
            if column not in columns:
                columns[column] = None
    if not groups:
        raise ConfigError(f"index {index} names no object below {root}", url=index)
    out: list[Sample] = []
    for key in sorted(groups):
        members, fields, _ = groups[key]
        if len(members) > 1:
            members.sort(key=lambda m: m.name)
        for a, b in itertools.pairwise(members):
            if a.name == b.name:
                (first, x), (second, y) = sorted(((a.where, a.relkey), (b.where, b.relkey)))
                if x == y:
                    what, fix = f"name {root}/{x}", "one row per object"
                else:
                    what = f"give member {a.name!r} of {key!r} ({root}/{x} and {root}/{y})"
                    fix = same_member(x, y) if x.lower() == y.lower() else "one row per object"
                raise ConfigError(
                    f"{tmpl.format(first)} and {tmpl.format(second)} both {what}: {fix}", url=index
                )
        if len(fields) < len(columns):
            for column in columns:
                fields.setdefault(column, None)
        out.append((key, members, fields))
    return out


# -- S3 Inventory --------------------------------------------------------------------------------


class _Where:
    """A row's place, formatted only when an error names it."""

    __slots__ = ("n", "tmpl")

    def __init__(self, tmpl: str, n: int) -> None:
        self.tmpl, self.n = tmpl, n

    def __str__(self) -> str:
        return self.tmpl.format(self.n)

    __format__ = lambda self, spec: str(self)  # noqa: E731


def _inventory(
    root: str, source: str, storage_options: Mapping[str, Any]
) -> Iterator[tuple[int, dict[str, Any]]]:
    raw = read_bytes(source, storage_options, what="S3 Inventory manifest")
    count = 0
    try:
        manifest = json.loads(raw)
        fmt = str(manifest["fileFormat"]).lower()
        files = [str(f["key"]) for f in manifest["files"]]
        dest = str(manifest["destinationBucket"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(
            f"S3 Inventory manifest {source} lacks fileFormat, files or destinationBucket ({exc!r})",
            url=source,
        ) from None
    if fmt not in ("csv", "parquet"):
        raise ConfigError(
            f"S3 Inventory {source} is {fmt}: blobdata reads CSV and Parquet reports", url=source
        )
    bucket = dest.rpartition(":")[2]  # arn:aws:s3:::bucket
    url = parse_url(root)
    want = url.prefix + "/" if url.prefix else ""
    schema = [c.strip() for c in str(manifest.get("fileSchema", "")).split(",")]
    for f in files:
        location = f"s3://{bucket}/{f}"
        # Streamed: a range of the report at a time, decompressed and parsed as it comes (_inventory_csv),
        # or a row group at a time (Parquet); never the whole report in memory.
        with open_bytes(location, storage_options, what="S3 Inventory file") as fh:
            if fmt == "csv":
                got = _inventory_csv(location, fh, schema)
            else:
                got = (
                    {_snake(k): v for k, v in r.items()}
                    for _, r in rows(location, fh, "parquet", what="inventory")
                )
            for row in got:
                key = row.get("key")
                if row.get("bucket") != url.bucket or not isinstance(key, str) or not key.startswith(want):
                    continue
                if key.endswith("/"):
                    continue  # a folder marker
                if _said(row.get("is_latest"), False) or _said(row.get("is_delete_marker"), True):
                    continue  # an all-versions report: only current versions that are not delete markers
                count += 1
                yield (
                    count,
                    {
                        "key": key[len(want) :],
                        "size": row.get("size"),
                        "etag": row.get("e_tag") or row.get("etag"),
                        "version_id": row.get("version_id"),
                    },
                )


def _said(value: Any, which: bool) -> bool:
    """Whether an inventory's boolean column says ``which`` (Parquet: a bool; CSV: ``true``/``false``);
    an absent or empty value says nothing."""
    if isinstance(value, str):
        return value.strip().lower() == ("true" if which else "false")
    return value is which


def _snake(name: str) -> str:
    """``ETag`` -> ``e_tag``, ``VersionId`` -> ``version_id``, ``key`` -> ``key`` (Parquet's names)."""
    out = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
    return out


#: The longest line of an inventory report (a key is at most 1,024 bytes, URL-encoded three times that).
MAX_LINE = 256 * 1024


def _lines(location: str, stream: BinaryIO) -> Iterator[str]:
    """The lines of ``stream`` (UTF-8), each at most :data:`MAX_LINE` bytes, read as they come."""
    n = 0
    while True:
        line = stream.readline(MAX_LINE + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE:
            raise ConfigError(
                f"S3 Inventory file {location} line {n} is longer than {MAX_LINE} bytes: not an inventory "
                "report (or a corrupt one)",
                url=location,
            )
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"S3 Inventory file {location} line {n} is not UTF-8 ({exc})", url=location
            ) from None


def _inventory_csv(location: str, fh: BinaryIO, schema: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of one CSV report, gzipped or not, decompressed and parsed as they are read: memory is a
    range of the report and a line, whatever it inflates to."""
    import csv

    names = [_snake(c) for c in schema]
    if "key" not in names:
        raise ConfigError(
            f"S3 Inventory file {location}: fileSchema {schema} has no Key column", url=location
        )
    head = fh.read(2)
    fh.seek(0)
    stream: BinaryIO = gzip.GzipFile(fileobj=fh, mode="rb") if head == b"\x1f\x8b" else fh  # type: ignore[assignment]
    reader = csv.reader(_lines(location, stream))
    try:
        for values in reader:
            if len(values) != len(names):
                raise ConfigError(
                    f"S3 Inventory file {location} line {reader.line_num} has {len(values)} values, the "
                    f"fileSchema {len(names)}",
                    url=location,
                )
            row: dict[str, Any] = dict(zip(names, values, strict=True))
            row["key"] = urllib.parse.unquote_plus(row["key"])  # keys in CSV reports are URL-encoded
            yield row
    except (csv.Error, gzip.BadGzipFile, EOFError, zlib.error) as exc:  # a corrupt gzip stream, a bad line
        raise ConfigError(
            f"S3 Inventory file {location} line {reader.line_num + 1} cannot be read: {exc}", url=location
        ) from None

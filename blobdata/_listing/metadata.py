"""Hugging Face's metadata files as samples: one row, one sample.

``file_name`` names the sample's main object (relative to the dataset's URL); ``<name>_file_name``
another object, member ``<name>``; ``file_names`` and ``<name>_file_names`` lists of objects, members
``files`` and ``<name>`` (lists). Every other column is a field of the sample (typed as Hugging Face
types it: :mod:`blobdata._tables.columns`). The sample's key is the main object's by webdataset's rule
(in a row of ``file_names`` only, the first object's), and its member is named as in a folder
(``x.JPG``: ``"jpg"``), so a transform reads the same dict whether or not a metadata file is there. A
bad row, an object outside the dataset's URL and two rows for one key are errors naming the file and
the line. Rows naming objects that are not there are said all at once (how many, the first few by
line); with ``skip_missing`` (``on_error="skip"``) those rows are left out with a warning saying the
same.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import ConfigError, NotFound
from .._tables import format_of, place, read_bytes, resolve, rows
from .samples import Member, relative_key, split_key

__all__ = ["find_metadata", "samples_from_metadata"]

logger = logging.getLogger(__name__)

#: Missing objects named in a message, at most.
_SHOWN = 5

Sample = tuple[str, list[Member], dict[str, Any]]


def find_metadata(relkeys: Sequence[str], names: Sequence[str]) -> str | None:
    """The metadata file at the top of a listing (``relkeys``), in the order of ``names``, or None."""
    present = {k for k in relkeys if "/" not in k}
    for name in names:
        if name in present:
            return name
    return None


class _FileColumns:
    """The columns that name objects (``file_name``, ``<name>_file_names``, ...): read as text."""

    def __contains__(self, column: object) -> bool:
        return isinstance(column, str) and (
            column in ("file_name", "file_names") or column.endswith(("_file_name", "_file_names"))
        )


_FILE_COLUMNS = _FileColumns()


def _list(value: Any, where: str, column: str) -> list[Any]:
    if isinstance(value, str) and value.startswith("["):
        with contextlib.suppress(ValueError, RecursionError):
            value = json.loads(value)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: column {column!r} must be a list of objects, got {value!r}")
    return list(value)


def samples_from_metadata(
    root: str,
    metadata: str,
    objects: Mapping[str, tuple[int, str]],
    *,
    storage_options: Mapping[str, Any],
    skip_missing: bool = False,
) -> tuple[list[Sample], str]:
    """The samples the metadata file ``metadata`` (relative to ``root``, a path or a URL) describes, and
    the template naming their rows; ``objects``: what exists below ``root`` (key -> (size, identity)),
    from a listing or an index. Rows naming objects not in ``objects``: one NotFound for all, or with
    ``skip_missing`` left out with one warning."""
    source = resolve(metadata, root)
    data = read_bytes(source, storage_options, what="metadata")
    fmt = format_of(source)
    tmpl = place(source, fmt, "metadata")
    out: dict[str, tuple[str, Sample]] = {}
    missing: list[str] = []  # "<file> line N names <url>", in row order
    left_out: set[str] = set()  # keys of the rows naming a missing object
    for n, row in rows(source, data, fmt, what="metadata", keep=_FILE_COLUMNS):
        where = tmpl.format(n)
        before = len(missing)
        members: list[Member] = []
        fields: dict[str, Any] = {}
        main: str | None = None  # the object that gives the sample its key
        for column, value in row.items():
            if column == "file_name" or column.endswith("_file_name"):
                if value is None:  # an empty cell, a key absent from this row: no object
                    continue
                rel = relative_key(value, root, where, column)
                if column == "file_name":
                    split = split_key(rel)
                    name = split[1] if split is not None else "file"
                    main = rel
                else:
                    name = column[: -len("_file_name")]
                members.append(_member(root, rel, name, where, n, objects, missing))
            elif column == "file_names" or column.endswith("_file_names"):
                name = "files" if column == "file_names" else column[: -len("_file_names")]
                for v in _list(value, where, column) if value is not None else []:
                    rel = relative_key(v, root, where, column)
                    members.append(_member(root, rel, name + "[]", where, n, objects, missing))
            else:
                fields[column] = value
        if not members:
            raise ConfigError(
                f"{where} has no file_name: each row of a metadata file names its object in a file_name "
                "column (or its objects in file_names, <name>_file_name or <name>_file_names)", url=source,
            )  # fmt: skip
        if main is None:  # a row of file_names only (views of one sample): the first object names it
            main = members[0].relkey
        split = split_key(main)
        key = split[0] if split is not None else main
        if key in out:
            raise ConfigError(
                f"{where} and {out[key][0]} both describe sample {key!r}: one row per sample", url=source
            )
        out[key] = (where, (key, members, fields))
        if len(missing) > before:
            left_out.add(key)
    if missing:
        _missing(root, source, missing, len(left_out), skip_missing)
    if not out:
        raise ConfigError(f"metadata {source} has no row", url=source)
    kept = [out[k][1] for k in sorted(out) if k not in left_out]
    if not kept:
        raise NotFound(f"no row of {source} names an object that exists below {root}", url=source)
    return kept, tmpl


def _missing(root: str, source: str, missing: list[str], rows: int, skip: bool) -> None:
    """Say every missing object at once: a NotFound, or with ``skip`` a warning (the rows are left out)."""
    more = len(missing) - _SHOWN
    shown = "; ".join(missing[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
    head = (
        f"{len(missing)} object{'s' * (len(missing) != 1)} named in {source} "
        f"(in {rows} row{'s' * (rows != 1)}) do{'es' * (len(missing) == 1)} not exist below {root}: {shown}"
    )
    if skip:
        logger.warning("%s; on_error=\"skip\": those rows are left out", head)
        return
    first = missing[0].rpartition(" names ")[2]
    raise NotFound(
        f"{head}. Fix the rows or upload the objects, or pass on_error=\"skip\" to leave those rows out",
        url=first,
    )


def _member(
    root: str,
    rel: str,
    name: str,
    where: str,
    n: int,
    objects: Mapping[str, tuple[int, str]],
    missing: list[str],
) -> Member:
    """The member a row names; one not in ``objects`` is noted in ``missing`` (the row is then left out
    or the whole file refused)."""
    found = objects.get(rel)
    if found is None:
        missing.append(f"{where} names {root}/{rel}")
        return Member(rel, -1, "", name, n)
    return Member(rel, found[0], found[1], name, n)

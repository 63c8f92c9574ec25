"""Which objects make which samples of a :class:`~blobdata.BlobDataset`: a listing grouped by the key
rule, a metadata file's rows, or an index's rows (no listing at all)."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from .._config import FetchOptions
from .._errors import EmptyDatasetError
from .._url import printable
from .flat import load_or_list_flat
from .job.distributed import shared_manifest, shared_table
from .job.split import help_list
from .manifest import Manifest
from .samples import SampleTable, group_listing

__all__ = ["METADATA_NAMES", "build_table"]

logger = logging.getLogger(__name__)

#: Metadata files found by themselves at a dataset's root, in this order of preference.
METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Millions of rows make millions of small containers, none in a cycle: the cyclic collector, which
    would scan them all again and again as they pile up, is paused meanwhile (1M rows: 14 s -> 8 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_no_cycle_collection()
def build_table(
    root: str,
    *,
    storage_options: Mapping[str, Any],
    metadata: str | None,
    index: str | None,
    manifest: str | None,
    refresh: bool,
    max_age: float | str | None,
    fetch_options: FetchOptions,
    share: bool,
    skip_missing: bool = False,
) -> SampleTable:
    """The samples of the dataset at ``root`` (see :class:`~blobdata.BlobDataset`); the cycle
    collector paused while millions of rows become a table. ``skip_missing``: a metadata file's rows
    naming objects that are not there are left out (``on_error="skip"``), else refused all at once."""
    from .metadata import find_metadata

    if index is not None:  # read by rank 0 alone; the others receive its table
        from_index = functools.partial(_from_index, root, index, metadata, storage_options, skip_missing)
        return shared_table(root, from_index, key=f"index|{index}|{metadata}") if share else from_index()
    make = functools.partial(
        load_or_list_flat, root, storage_options=storage_options, refresh=refresh, manifest=manifest,
        fetch_options=fetch_options, max_age=max_age,
    )  # fmt: skip
    help = functools.partial(help_list, root, storage_options=storage_options, fetch_options=fetch_options,
                             flat=True)  # fmt: skip
    listing = shared_manifest(root, make, key="flat", help=help) if share else make()
    relkeys = [listing.relkey(j) for j in range(len(listing))]
    if metadata is None:
        name = find_metadata(relkeys, METADATA_NAMES)
        # The file found is the dataset's own: its URL, never a path that may also name a local file
        # (a metadata.jsonl in the working directory).
        metadata = None if name is None else f"{root.rstrip('/')}/{name}"
    if metadata is None:
        entries = zip(
            relkeys,
            listing.sizes.tolist(),
            [listing.identity(j) for j in range(len(listing))],
            strict=True,
        )
        grouped, left, hidden = group_listing(root, entries)
        if left:
            logger.info("%d object(s) under %s have no extension and belong to no sample, e.g. %s",
                        len(left), root, printable(", ".join(left[:3])))  # fmt: skip
        if hidden:
            logger.info("%d object(s) under %s lie in hidden or special folders (.x/, __x/), which Hugging "
                        "Face skips too, and belong to no sample, e.g. %s", len(hidden), root,
                        printable(", ".join(hidden[:3])))  # fmt: skip
            if not grouped:
                raise EmptyDatasetError(
                    f"no sample in {root}: its {len(hidden)} object(s) with an extension all lie in hidden "
                    f"or special folders (e.g. {root}/{hidden[0]}), which a listing skips as Hugging Face "
                    "does; name them in an index= or a metadata file to read them",
                    url=root,
                )
        return _table(root, grouped, root, "", listing)
    found = metadata

    def from_metadata() -> SampleTable:  # read by rank 0 alone; the others receive its table
        objects = {rk: (int(listing.sizes[j]), listing.identity(j)) for j, rk in enumerate(relkeys)}
        return _from_metadata(root, found, objects, storage_options, skip_missing)

    table = shared_table(root, from_metadata, key=f"metadata|{metadata}") if share else from_metadata()
    table.listing = listing
    return table


def _from_index(
    root: str, index: str, metadata: str | None, storage_options: Mapping[str, Any], skip_missing: bool
) -> SampleTable:
    """The samples an index (or a saved table) names, or, with ``metadata``, its rows over those objects."""
    from .index import read_index

    saved, data = _saved_table(root, index, storage_options)
    if saved is not None:
        if metadata is None:
            return saved
        objects = {
            saved.relkey(j): (int(saved.sizes[j]), saved.identity(j)) for j in range(saved.num_objects)
        }
    else:
        rows, where = read_index(root, index, storage_options=storage_options, data=data)
        if metadata is None:
            return _table(root, rows, f"index {index}", where)
        objects = {m.relkey: (m.size, m.identity) for _, ms, _ in rows for m in ms}
    return _from_metadata(root, metadata, objects, storage_options, skip_missing)


def _from_metadata(
    root: str,
    metadata: str,
    objects: dict[str, tuple[int, str]],
    storage_options: Mapping[str, Any],
    skip_missing: bool = False,
) -> SampleTable:
    from .metadata import samples_from_metadata

    samples, where = samples_from_metadata(
        root, metadata, objects, storage_options=storage_options, skip_missing=skip_missing
    )
    return _table(root, samples, f"metadata {metadata}", where)


def _saved_table(
    root: str, index: str, storage_options: Mapping[str, Any]
) -> tuple[SampleTable | None, bytes | None]:
    """The table saved at ``index`` (``blobdata ls --index --save-manifest``, known by its magic bytes),
    else None and the index's bytes when they had to be read to tell (a URL)."""
    from .._tables import read_bytes
    from .tablefile import TABLE_MAGIC, is_table, load_table

    if index.rstrip("/").endswith("manifest.json"):
        return None, None
    if "://" not in index or index.startswith("file://"):
        path = os.path.expanduser(index[len("file://") :] if index.startswith("file://") else index)
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(TABLE_MAGIC))
        except OSError:
            return None, None  # read_index names the problem
        if not is_table(head):
            return None, None
        return load_table(index, storage_options=storage_options, expect_root=root), None
    data = read_bytes(index, storage_options, what="index")
    if not is_table(data):
        return None, data
    return load_table(index, expect_root=root, data=data), None


def _table(root: str, samples: Any, source: str, where: str, listing: Manifest | None = None) -> SampleTable:
    if not samples:
        raise EmptyDatasetError(f"no sample in {source}: no object with an extension below {root}", url=root)
    table = SampleTable(root, samples, where=where)
    table.listing = listing
    return table

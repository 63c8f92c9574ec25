"""Listing a flat folder: every object below the root, at any depth, remembered as folders' listings are.

A :class:`~blobdata.BlobDataset` without an index reads what lies below its URL. The store's lister
is asked for everything below the root's last path segment, from the root's parent (the one operation
every store's lister has: :meth:`~blobdata._stores.Lister.below`), so the root's own files are included.
The listing is a :class:`~blobdata.Manifest` (one class, ``""``), remembered under
:func:`~blobdata._listing.manifest_path` with ``{"layout": "flat"}`` as its parameters, and reused as
:func:`~blobdata._listing.load_or_list` reuses a folder's (``refresh``, ``listing_max_age``,
``manifest=``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions, parse_duration
from .._errors import BlobdataError, NotFound
from .._loop import run
from .._retry import final_error
from .._stores import Columns, credential_hint, lister_for, listing_scope, resolve_storage_options
from .._url import parse_url
from .bulk import key_sorted, starting_with
from .folders import _scheme_hint
from .job import split
from .job.split import Job, parent_of
from .manifest import Manifest, manifest_path
from .remembered import load_remembered, remember_listing

__all__ = ["FLAT_PARAMS", "list_flat", "load_or_list_flat"]

logger = logging.getLogger(__name__)

#: The listing parameters of a flat listing (its remembered file's name hashes them).
FLAT_PARAMS: dict[str, Any] = {"layout": "flat"}


def list_flat(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fetch_options: FetchOptions | None = None,
    together: Job | None = None,
) -> Manifest:
    """Every object below ``url`` (any depth), sorted by key; folder markers left out. ``together``: rank
    0's side of a listing split across the job (:mod:`blobdata._listing.job.split`)."""
    parsed = parse_url(url)
    root = str(parsed)
    options = fetch_options if fetch_options is not None else FetchOptions()
    opts = resolve_storage_options(parsed.protocol, storage_options)
    parent, name = parent_of(parsed)
    listed_at = time.time()

    async def go() -> Columns:
        lister = lister_for(parent, opts, options)
        try:
            return await lister.below(name)
        finally:
            await lister.aclose()

    try:
        if together is not None:
            got = split.together(lambda: (parent, opts), options, together, lambda lister: _one(name))
            assert got is not None  # rank 0's
            found = got[1][0]
        else:
            found = run(go())
    except BlobdataError:
        raise
    except FileNotFoundError:
        found = Columns.empty()
    except Exception as exc:
        hint = credential_hint(parsed.protocol)
        raise final_error(exc, root, hint=hint, what="listing", timeout=options.timeout) from exc
    head = (name + "/").encode("utf-8", "surrogatepass")
    objects = key_sorted(found.take(starting_with(found, head)).cut(len(head)))
    del found
    if not len(objects):
        if parsed.protocol == "file" and not os.path.exists(parsed.prefix):  # as FolderDataset says it
            raise NotFound(
                f"nothing found at {root}: no such local folder{_scheme_hint(parsed.prefix)}", url=root
            )
        raise NotFound(f"nothing found at {root}: check the bucket and prefix (or the local path)", url=root)
    return Manifest.from_arrays(
        root, [""], keys=objects.keys, key_offsets=objects.key_offsets, sizes=objects.sizes,
        targets=np.zeros(len(objects), dtype=np.int32), ids=objects.ids, id_offsets=objects.id_offsets,
        listed_at=listed_at, params=FLAT_PARAMS,
    )  # fmt: skip


async def _one(name: str) -> list[str]:
    return [name]


def load_or_list_flat(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    refresh: bool = False,
    manifest: str | os.PathLike[str] | None = None,
    fetch_options: FetchOptions | None = None,
    max_age: float | str | None = DEFAULT_LISTING_MAX_AGE,
    together: Job | None = None,
) -> Manifest:
    """The remembered flat listing of ``url`` (see the module docstring); ``together``: rank 0's side of
    a listing split across the job (:mod:`blobdata._listing.job.split`)."""
    with split.leading(together):
        return _load_or_list_flat(url, storage_options, refresh, manifest, fetch_options, max_age, together)


def _load_or_list_flat(
    url: str,
    storage_options: Mapping[str, Any] | None,
    refresh: bool,
    manifest: str | os.PathLike[str] | None,
    fetch_options: FetchOptions | None,
    max_age: float | str | None,
    together: Job | None,
) -> Manifest:
    parsed = parse_url(url)
    root = str(parsed)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    if manifest is not None:
        split.announce(together, listing=False)
        source = os.fspath(manifest)
        m_proto = parse_url(source).protocol if "://" in source else "file"
        return Manifest.load(
            source, storage_options=opts if m_proto == parsed.protocol else None, expect_root=root
        )
    if max_age is not None:  # a bad value is refused whatever the store
        parse_duration(max_age, name="listing_max_age")
    remember = parsed.protocol not in ("memory", "file")
    path = manifest_path(root, listing_scope(parsed.protocol, opts), FLAT_PARAMS)
    loaded = load_remembered(path, root, max_age) if remember and not refresh else None
    if loaded is not None:
        split.announce(together, listing=False)
        return loaded
    split.announce(together, listing=True)
    listed = list_flat(url, storage_options=opts, fetch_options=fetch_options, together=together)
    return remember_listing(listed, path) if remember else listed

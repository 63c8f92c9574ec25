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

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions, parse_duration
from .._errors import BlobdataError, ConfigError, NotFound
from .._loop import run
from .._retry import final_error
from .._stores import credential_hint, lister_for, listing_scope, resolve_storage_options
from .._url import BlobURL, parse_url
from .folders import _scheme_hint, load_remembered, remember_listing
from .manifest import Manifest, manifest_path

__all__ = ["FLAT_PARAMS", "list_flat", "load_or_list_flat"]

logger = logging.getLogger(__name__)

#: The listing parameters of a flat listing (its remembered file's name hashes them).
FLAT_PARAMS: dict[str, Any] = {"layout": "flat"}


def _parent(url: BlobURL) -> tuple[BlobURL, str]:
    if url.protocol in ("file", "memory"):
        head, _, name = url.prefix.rstrip("/").rpartition("/")
        if not name:
            raise ConfigError(f"{url} is a filesystem root: name a folder below it", url=str(url))
        return BlobURL(url.protocol, "", head or "/"), name
    if not url.prefix:
        raise ConfigError(
            f"{url} is a bucket's root: a BlobDataset lists a folder below it (s3://bucket/folder), or "
            "pass index= to name the objects without a listing",
            url=str(url),
        )
    head, _, name = url.prefix.rpartition("/")
    return BlobURL(url.protocol, url.bucket, head), name


def list_flat(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fetch_options: FetchOptions | None = None,
) -> Manifest:
    """Every object below ``url`` (any depth), sorted by key; folder markers left out."""
    parsed = parse_url(url)
    root = str(parsed)
    options = fetch_options if fetch_options is not None else FetchOptions()
    opts = resolve_storage_options(parsed.protocol, storage_options)
    parent, name = _parent(parsed)
    listed_at = time.time()

    async def go() -> list[tuple[str, int, str]]:
        lister = lister_for(parent, opts, options)
        try:
            return await lister.below(name)
        finally:
            await lister.aclose()

    try:
        found = run(go())
    except BlobdataError:
        raise
    except FileNotFoundError:
        found = []
    except Exception as exc:
        hint = credential_hint(parsed.protocol)
        raise final_error(exc, root, hint=hint, what="listing", timeout=options.timeout) from exc
    cut = len(name) + 1
    entries = sorted((k[cut:], s, i) for k, s, i in found if k.startswith(name + "/") and not k.endswith("/"))
    if not entries:
        if parsed.protocol == "file" and not os.path.exists(parsed.prefix):  # as FolderDataset says it
            raise NotFound(
                f"nothing found at {root}: no such local folder{_scheme_hint(parsed.prefix)}", url=root
            )
        raise NotFound(f"nothing found at {root}: check the bucket and prefix (or the local path)", url=root)
    return Manifest.from_entries(
        root, [""], ((k, s, i, 0) for k, s, i in entries), listed_at=listed_at, params=FLAT_PARAMS
    )


def load_or_list_flat(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    refresh: bool = False,
    manifest: str | os.PathLike[str] | None = None,
    fetch_options: FetchOptions | None = None,
    max_age: float | str | None = DEFAULT_LISTING_MAX_AGE,
) -> Manifest:
    """The remembered flat listing of ``url`` (see the module docstring)."""
    parsed = parse_url(url)
    root = str(parsed)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    if manifest is not None:
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
        return loaded
    listed = list_flat(url, storage_options=opts, fetch_options=fetch_options)
    return remember_listing(listed, path) if remember else listed

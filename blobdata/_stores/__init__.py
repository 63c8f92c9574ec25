"""Where bytes come from: one module per store, each with its reader, its lister and its identity rule.

================  ======================================  ===========================================
store             reader (one object, one attempt)        lister (what lies below a folder)
================  ======================================  ===========================================
``s3://``         :class:`.s3.S3Reader` (SigV4 over h1)   :class:`.s3.S3LeanLister` (or s3fs)
``gs://``         :class:`.gcs.GCSReader` (aiohttp)       :class:`.gcs.GCSLister` (objects.list, aiohttp)
``az://``         :class:`.azure.AzureReader` (SDK)       adlfs through :class:`.fsspec.AsyncFsLister`
local, file://    :class:`.local.LocalReader`             :class:`.local.LocalLister` (as torchvision)
``memory://``     :class:`.fsspec.FsspecReader`           :class:`.fsspec.MemoryLister`
================  ======================================  ===========================================

S3 is a package of its own (:mod:`.s3`: the reader, SigV4, node credentials, the listing, its ranges
and its pages). Beside the readers: :mod:`.s3.ranges` lists one S3 or GCS prefix in parallel (ranges of
its key space), :mod:`.s3.credentials` resolves refreshable AWS credentials once per node, and each
store module's
``STORE`` (a :class:`~.base.StoreInfo`) holds its facts: the environment it reads, what names its
listings and its throttle controller, what to check when it refuses credentials.

:func:`reader_for` and :func:`lister_for` pick them; nothing outside this package names a store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._config import FetchOptions
from .._url import BlobURL
from . import local
from .base import (
    Columns,
    Entry,
    Growing,
    Lister,
    Reader,
    ReadResult,
    StoreInfo,
    gather,
    list_requests,
    listed_size,
)
from .fsspec import AsyncFsLister, FsspecReader, MemoryLister, get_fs, memory_identity
from .h1 import H1Pool
from .local import network_mount
from .local import read_file as read_local_file
from .options import options_token, redact
from .s3 import Board, LocalBoard, Part, RangeInfo, consistent

__all__ = [
    "Board",
    "Columns",
    "Entry",
    "Growing",
    "H1Pool",
    "Lister",
    "LocalBoard",
    "Part",
    "RangeInfo",
    "ReadResult",
    "Reader",
    "StoreInfo",
    "consistent",
    "credential_hint",
    "gather",
    "get_fs",
    "identity_from_info",
    "list_requests",
    "listed_size",
    "lister_for",
    "listing_scope",
    "network_mount",
    "options_token",
    "read_local_file",
    "reader_for",
    "redact",
    "resolve_storage_options",
    "store_info",
]


def store_info(protocol: str) -> StoreInfo:
    """The facts of ``protocol``'s store (``STORE`` in its module): how it reads the environment, what
    names a listing and a throttle controller of it, what to check when it refuses credentials."""
    if protocol == "s3":
        from .s3 import STORE

        return STORE
    if protocol in ("gs", "gcs"):
        from .gcs import STORE

        return STORE
    if protocol in ("az", "abfs"):
        from .azure import STORE

        return STORE
    return StoreInfo(protocol)  # local files, memory://: no environment, no credentials


def resolve_storage_options(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Storage options for ``protocol`` with the ecosystem's environment (endpoints, emulator hosts,
    credentials) folded in. Explicit options win over the environment; nothing else reads it."""
    return store_info(protocol).resolved(storage_options)


def listing_scope(protocol: str, storage_options: Mapping[str, Any]) -> str:
    """What a bucket listing depends on besides the URL: the endpoint (or Azure account), never the
    credentials, so that one URL has one remembered listing however its credentials are given."""
    return store_info(protocol).scope(storage_options)


def credential_hint(protocol: str) -> str:
    """What to check when ``protocol``'s store refuses the credentials (for error messages)."""
    return store_info(protocol).credential_hint


def reader_for(protocol: str, storage_options: Mapping[str, Any], *, concurrency: int) -> Reader:
    """The reader of ``protocol`` for these (resolved) storage options; ``concurrency`` sizes its pool."""
    if protocol == "s3":
        from .s3 import S3Reader

        return S3Reader(storage_options, concurrency=concurrency)
    if protocol == "gs":
        from .gcs import GCSReader

        return GCSReader(storage_options, concurrency=concurrency)
    if protocol == "az":
        from .azure import AzureReader

        return AzureReader(storage_options, concurrency=concurrency)
    if protocol == "file":
        return local.LocalReader()
    return FsspecReader(protocol, storage_options)


def _identity_rule(protocol: str) -> Callable[[Mapping[str, Any]], str]:
    if protocol == "s3":
        from .s3 import identity

        return identity
    if protocol in ("gs", "gcs"):
        from .gcs import identity

        return identity
    if protocol in ("az", "abfs"):
        from .azure import identity

        return identity
    if protocol == "file":
        return local.identity
    return memory_identity


def identity_from_info(protocol: str, info: Mapping[str, Any]) -> str:
    """The string that changes when the object changes, from an fsspec info dict.

    s3: ETag without quotes, plus ``@VersionId`` when the listing has one; gs: the generation;
    az: the etag without quotes; file: ``"{mtime_ns}-{size}"``; memory: ``"{created}-{size}"``.
    """
    return _identity_rule(protocol)(info)


def lister_for(url: BlobURL, storage_options: Mapping[str, Any], options: FetchOptions) -> Lister:
    """The lister of ``url``'s store; every request it makes obeys ``options`` (timeout, attempts)."""
    if url.protocol == "file":
        return local.LocalLister(url)
    if url.protocol == "s3":
        from .s3 import S3LeanLister, lean_s3

        if lean_s3(storage_options):
            return S3LeanLister(url, storage_options, options)
    if url.protocol == "gs":
        from .gcs import GCSLister

        return GCSLister(url, storage_options, options)
    fs = get_fs(url.protocol, storage_options)
    if url.protocol == "memory":
        return MemoryLister(url, fs)
    if url.protocol == "s3":
        from .s3 import S3fsLister

        return S3fsLister(url, fs, options)
    return AsyncFsLister(url, fs, identity=_identity_rule(url.protocol), options=options, store=url.protocol)

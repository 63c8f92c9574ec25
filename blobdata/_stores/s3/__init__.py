"""S3, one module per part: the reader and what it stands on, the listing and what it stands on.

==================  ===================================================================================
``reader``          :class:`S3Reader`: signed GETs pinned to the listed ETag, and one ListObjectsV2 page
``sigv4``           AWS Signature V4 and the credential chain, resolved once per process
``credentials``     refreshable AWS credentials resolved once per node, shared in ``_node``'s directory
``listing``         :class:`S3LeanLister` (or s3fs's, for options only s3fs reads) and :class:`PagedLister`,
                    the page checks S3's and GCS's listers share
``ranges``          one prefix listed in key ranges at once, claimed from a frontier on a :class:`Board`
``xml``             a ListObjectsV2 page straight to columns (numpy), ElementTree for what that does not
                    prove
==================  ===================================================================================

The interface of ``blobdata._stores`` is unchanged (:func:`~blobdata._stores.reader_for`,
:func:`~blobdata._stores.lister_for`, ...); the reader and the listing are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .ranges import Board, LocalBoard, Part, RangeInfo, consistent, list_part, list_prefix
from .xml import ListPage, list_query, parse_list_page

if TYPE_CHECKING:
    from .listing import PagedLister, S3fsLister, S3LeanLister, identity, lean_s3
    from .reader import STORE, S3Reader

__all__ = [
    "STORE",
    "Board",
    "ListPage",
    "LocalBoard",
    "PagedLister",
    "Part",
    "RangeInfo",
    "S3LeanLister",
    "S3Reader",
    "S3fsLister",
    "consistent",
    "identity",
    "lean_s3",
    "list_part",
    "list_prefix",
    "list_query",
    "parse_list_page",
]

_LAZY = {"STORE": "reader", "S3Reader": "reader", "PagedLister": "listing", "S3LeanLister": "listing",
         "S3fsLister": "listing", "identity": "listing", "lean_s3": "listing"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # the reader and the listing (TLS, the HTTP client, credentials) on first use
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

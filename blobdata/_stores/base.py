"""What every store provides: a :class:`Reader` (bytes of one object) and a :class:`Lister` (what lies
below a folder), plus the identity rule that says when an object changed.

A store module (``s3``, ``gcs``, ``azure``, ``local``, ``fsspec``) holds its reader, its lister and its
identity rule together. Readers make exactly one attempt per call: final failures raise blobdata's
errors, retryable ones :class:`~blobdata._errors.TransientError` (through the one error map,
:func:`blobdata._errors.from_status` / :func:`~blobdata._errors.translate`); the retry budget is
:mod:`blobdata._retry`'s. Nothing here knows about caching, look-ahead or decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .._errors import ManifestError

__all__ = [
    "count_list",
    "list_requests",
    "MAX_LISTED_SIZE", "Entry", "Lister", "ReadResult", "Reader", "StoreInfo", "check_header_identity",
    "listed_size",
]  # fmt: skip

#: The largest object size a listing may state, in bytes (1 PiB; S3's own limit is 50 TB).
MAX_LISTED_SIZE = 1 << 50


class ReadResult(NamedTuple):
    """One successful read: the bytes, the identity the store reported (``""`` if unknown) and the
    object's total size in bytes (``None`` if the store did not say)."""

    body: bytes
    identity: str
    total: int | None


#: One listed object: (key relative to the dataset root, exactly as stored; size in bytes; identity).
Entry = tuple[str, int, str]


def listed_size(value: object, url: str) -> int:
    """A listed object's size in bytes, from the store's text or number; a :class:`ManifestError`
    naming ``url`` (the object) when it is not a whole number from 0 to :data:`MAX_LISTED_SIZE`."""
    text = str(value).strip()
    if isinstance(value, bool) or not (text.isascii() and text.isdigit()) or len(text) > 16:
        size = -1
    else:
        size = int(text)
    if not 0 <= size <= MAX_LISTED_SIZE:
        raise ManifestError(
            f"the listing states a size of {text[:40]!r} bytes for {url}, not a whole number from 0 to "
            f"{MAX_LISTED_SIZE}: the store or a proxy sent a corrupt listing",
            url,
        )
    return size


def check_header_identity(identity: str, url: str) -> None:
    """A :class:`ManifestError` naming ``url`` unless ``identity`` (an ETag to send as ``If-Match``) can
    be a header's value: printable, Latin-1. An index or a manifest is data, and a line break in an ETag
    would start another header; refused here, in words, before any request is made."""
    if identity.isprintable() and (identity.isascii() or max(identity) <= "\xff"):
        return
    raise ManifestError(
        f"the ETag {identity!r} given for {url} cannot be sent in a request header (a line break, a control "
        "character or a character outside Latin-1): fix the etag column of the index or listing that gives "
        "it, or leave it empty (the ETag is then learned at the first read)",
        url,
    )


class Reader(Protocol):
    """Reads one object (or the byte range ``[start, end)``) in one attempt.

    Must raise NotFound / AccessDenied / ObjectChanged / FetchError for final failures and
    :class:`~blobdata._errors.TransientError` for retryable ones (a body shorter than announced is
    ``short_read``, retried like a reset), and honour ``timeout`` (seconds). With ``expect_identity``
    it must refuse (ObjectChanged) an object whose identity differs, where the store can tell, and
    never take an answer without an identity as a match. ``size`` is the listed size in bytes (None
    if unknown): a network reader refuses a body longer than that (or than the range) before
    buffering it, and may raise :class:`~blobdata._errors.RangeIgnored` when a store answers a
    range with the whole object. For ``file``/``memory`` the bucket is ``""`` and the key is the path.
    """

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None,
        end: int | None,
        expect_identity: str | None,
        timeout: float,
        size: int | None = None,
    ) -> ReadResult: ...

    async def close(self) -> None: ...


class Lister(Protocol):
    """Two operations per store; keys are relative to the dataset root, exactly as stored."""

    async def folders(self) -> tuple[list[str], bool]:
        """(names of the immediate sub-folders, whether anything at all lies below the root)."""
        ...

    async def below(self, folder: str) -> list[Entry]:
        """Every object below ``root/folder/``, folder markers included."""
        ...

    async def aclose(self) -> None:
        """Release what the lister opened itself."""
        ...


def _no_options(opts: dict[str, Any]) -> None:
    """Nothing to fold in: the store reads no environment."""


@dataclass(frozen=True)
class StoreInfo:
    """One store's facts, in one place (its module's ``STORE``): everything outside ``_stores/`` that
    depends on which store a URL names asks this, never the protocol's name.

    ``resolve`` folds the ecosystem's environment (endpoints, emulator hosts, credentials) into a
    copy of the storage options, in place; explicit options win. ``listing_scope`` is what a
    remembered listing depends on besides the URL (the endpoint or account, never credentials);
    ``endpoint`` what names the store for its throttle controller (the listing scope, plus what tells
    apart accounts that share a name); ``throttle_bucket`` and ``throttle_prefix`` whether the store
    limits request rates per bucket and per prefix. ``credential_hint`` is what to check when the
    store refuses the credentials.
    """

    protocol: str
    credential_hint: str = "check the credentials in storage_options and the bucket policy"
    resolve: Callable[[dict[str, Any]], None] = _no_options
    listing_scope: Callable[[Mapping[str, Any]], str] | None = None
    endpoint: Callable[[Mapping[str, Any]], str] | None = None
    throttle_bucket: bool = True
    throttle_prefix: bool = False

    def resolved(self, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
        """A copy of ``storage_options`` with the environment folded in (explicit options win)."""
        opts = dict(storage_options or {})
        self.resolve(opts)
        return opts

    def scope(self, storage_options: Mapping[str, Any]) -> str:
        return self.listing_scope(storage_options) if self.listing_scope else self.protocol

    def endpoint_of(self, storage_options: Mapping[str, Any]) -> str:
        return self.endpoint(storage_options) if self.endpoint else self.scope(storage_options)


#: LIST requests this process sent to stores (S3's and GCS's pages; a listing call of an fsspec lister).
_lists = [0]


def count_list(n: int = 1) -> None:
    """``n`` LIST requests were sent (on the loop)."""
    _lists[0] += n


def list_requests() -> int:
    """LIST requests this process sent so far (a dataset takes the difference over its construction)."""
    return _lists[0]

"""What every store provides: a :class:`Reader` (bytes of one object) and a :class:`Lister` (what lies
below a folder), plus the identity rule that says when an object changed.

A store module (``s3``, ``gcs``, ``azure``, ``local``, ``fsspec``) holds its reader, its lister and its
identity rule together. Readers make exactly one attempt per call: final failures raise blobdata's
errors, retryable ones :class:`~blobdata._errors.TransientError` (through the one error map,
:func:`blobdata._errors.from_status` / :func:`~blobdata._errors.translate`); the retry budget is
:mod:`blobdata._retry`'s. Nothing here knows about caching, look-ahead or decoding.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = ["Entry", "Lister", "ReadResult", "Reader"]


class ReadResult(NamedTuple):
    """One successful read: the bytes, the identity the store reported (``""`` if unknown) and the
    object's total size in bytes (``None`` if the store did not say)."""

    body: bytes
    identity: str
    total: int | None


#: One listed object: (key relative to the dataset root, exactly as stored; size in bytes; identity).
Entry = tuple[str, int, str]


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

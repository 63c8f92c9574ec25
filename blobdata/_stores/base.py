"""What every store provides: a :class:`Reader` (bytes of one object) and a :class:`Lister` (what lies
below a folder), plus the identity rule that says when an object changed.

A store module (``s3``, ``gcs``, ``azure``, ``local``, ``fsspec``) holds its reader, its lister and its
identity rule together. Readers make exactly one attempt per call: final failures raise blobdata's
errors, retryable ones :class:`~blobdata._errors.TransientError` (through the one error map,
:func:`blobdata._errors.from_status` / :func:`~blobdata._errors.translate`); the retry budget is
:mod:`blobdata._retry`'s. Nothing here knows about caching, look-ahead or decoding.

A lister returns :class:`Columns`: millions of listed objects without a Python object per object. The
keys' UTF-8 bytes (``surrogatepass``, so that any ``str`` round-trips) lie in one ``uint8`` buffer with
``n + 1`` int64 offsets, the sizes in an int64 array, the identities (ETag, generation, ...) in a second
buffer with its offsets: the layout of :class:`~blobdata.Manifest`'s arrays, so that a listing becomes a
manifest without a copy. :class:`Growing` collects pages into such arrays as they arrive: anonymous
memory maps that grow in place (``mremap``: no copy, and room not yet filled takes no memory), so a
listing holds about its result, never a list of tuples or two copies of it.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .._errors import ManifestError

__all__ = [
    "MAX_LISTED_SIZE", "Columns", "Entry", "Growing", "Lister", "ReadResult", "Reader", "StoreInfo",
    "check_header_identity", "count_list", "gather", "join_bytes", "list_requests", "listed_size",
]  # fmt: skip

_ENC, _ERRORS = "utf-8", "surrogatepass"
_FIRST_BYTES = 1 << 16  # the first room of a growing array

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

    async def below(self, folder: str) -> Columns:
        """Every object below ``root/folder/``, folder markers included (keys relative to the root)."""
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


# -- a listing as columns ---------------------------------------------------------------------------

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]


def join_bytes(parts: Sequence[bytes]) -> tuple[U8, I64]:
    """``parts`` in one uint8 buffer and their ``n + 1`` int64 offsets."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    if parts:
        np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
    return np.frombuffer(b"".join(parts), dtype=np.uint8), offsets


def gather(buf: U8, starts: I64, ends: I64) -> tuple[U8, I64]:
    """The byte ranges ``[starts[i], ends[i])`` of ``buf`` in one new buffer, with their ``n + 1`` offsets."""
    lengths = ends - starts
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, dtype=np.uint8), offsets
    width = int(lengths[0])
    if len(starts) > 1 and (lengths == width).all() and (np.diff(starts) == starts[1] - starts[0]).all():
        # Ranges of one length at one stride (a page of like entries): a strided view, copied.
        step = int(starts[1] - starts[0])
        if step >= 0 and int(starts[-1]) + width <= len(buf):
            view = np.lib.stride_tricks.as_strided(buf[int(starts[0]) :], (len(starts), width), (step, 1))
            return np.array(view, copy=True).reshape(-1), offsets
    pos = np.repeat(starts - offsets[:-1], lengths)
    pos += np.arange(total, dtype=np.int64)
    return buf[pos], offsets


class Columns:
    """``n`` listed objects: ``keys`` (uint8) with ``key_offsets`` (int64, ``n + 1``, from 0 to the
    buffer's length), ``sizes`` (int64, bytes), ``ids`` (uint8) with ``id_offsets`` (likewise). Keys as
    the lister states them (relative to its root), in its order."""

    __slots__ = ("id_offsets", "ids", "key_offsets", "keys", "sizes")

    def __init__(self, keys: U8, key_offsets: I64, sizes: I64, ids: U8, id_offsets: I64) -> None:
        self.keys, self.key_offsets, self.sizes = keys, key_offsets, sizes
        self.ids, self.id_offsets = ids, id_offsets

    @classmethod
    def empty(cls) -> Columns:
        none = np.zeros(1, dtype=np.int64)
        return cls(np.zeros(0, np.uint8), none, np.zeros(0, np.int64), np.zeros(0, np.uint8), none.copy())

    @classmethod
    def from_entries(cls, entries: Iterable[tuple[str, int, str]]) -> Columns:
        """From ``(key, size, identity)`` tuples (the listers that list one object at a time)."""
        keys: list[bytes] = []
        ids: list[bytes] = []
        sizes: list[int] = []
        for key, size, ident in entries:
            keys.append(key.encode(_ENC, _ERRORS))
            sizes.append(size)
            ids.append(ident.encode(_ENC, _ERRORS))
        kb, ko = join_bytes(keys)
        ib, io = join_bytes(ids)
        return cls(kb, ko, np.array(sizes, dtype=np.int64), ib, io)

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Columns({len(self)} objects, {len(self.keys)} key bytes)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Columns):
            return NotImplemented
        mine: tuple[npt.NDArray[Any], ...] = self._arrays()
        theirs: tuple[npt.NDArray[Any], ...] = other._arrays()
        return all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def _arrays(self) -> tuple[U8, I64, I64, U8, I64]:
        return self.keys, self.key_offsets, self.sizes, self.ids, self.id_offsets

    def key_bytes(self, i: int) -> bytes:
        return self.keys[self.key_offsets[i] : self.key_offsets[i + 1]].tobytes()

    def key(self, i: int) -> str:
        return self.key_bytes(i).decode(_ENC, _ERRORS)

    def identity(self, i: int) -> str:
        return self.ids[self.id_offsets[i] : self.id_offsets[i + 1]].tobytes().decode(_ENC, _ERRORS)

    def key_list(self) -> list[str]:
        """Every key as a ``str`` (a Python object each: for small listings and tests)."""
        data, offs = self.keys.tobytes(), self.key_offsets.tolist()
        return [data[offs[i] : offs[i + 1]].decode(_ENC, _ERRORS) for i in range(len(self))]

    def id_list(self) -> list[str]:
        data, offs = self.ids.tobytes(), self.id_offsets.tolist()
        return [data[offs[i] : offs[i + 1]].decode(_ENC, _ERRORS) for i in range(len(self))]

    def entries(self) -> list[tuple[str, int, str]]:
        """``(key, size, identity)`` tuples (for small listings and tests)."""
        return list(zip(self.key_list(), self.sizes.tolist(), self.id_list(), strict=True))

    def __iter__(self) -> Iterator[tuple[str, int, str]]:
        return iter(self.entries())

    def take(self, rows: npt.ArrayLike) -> Columns:
        """The objects ``rows`` (indices, or a boolean mask), in that order."""
        idx = np.asarray(rows)
        if idx.dtype == np.bool_:
            if bool(idx.all()):
                return self
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        keys, key_offsets = gather(self.keys, self.key_offsets[idx], self.key_offsets[idx + 1])
        ids, id_offsets = gather(self.ids, self.id_offsets[idx], self.id_offsets[idx + 1])
        return Columns(keys, key_offsets, self.sizes[idx], ids, id_offsets)

    def grid(self, lo: int = 0, hi: int | None = None, first: bytes | None = None) -> npt.NDArray[np.uint8]:
        """Keys ``lo`` to ``hi`` as a 2-d uint8 array, a key a row, padded with zeros (``first`` as an
        extra row 0 when given): rows compare as the keys do when no key holds a NUL byte. Keys of one
        length (and no ``first``) are a view of the buffer."""
        hi = len(self) if hi is None else hi
        offs = self.key_offsets[lo : hi + 1]
        lengths = np.diff(offs)
        start = int(offs[0])
        if first is None and len(lengths) and int(lengths[0]) and (lengths == lengths[0]).all():
            return self.keys[start : int(offs[-1])].reshape(len(lengths), int(lengths[0]))
        extra = 0 if first is None else 1
        width = max(int(lengths.max()) if len(lengths) else 0, len(first or b""), 1)
        grid = np.zeros((len(lengths) + extra, width), dtype=np.uint8)
        if first:
            grid[0, : len(first)] = np.frombuffer(first, np.uint8)
        rows = np.repeat(np.arange(extra, len(grid)), lengths)
        cols = np.arange(len(rows)) - np.repeat(offs[:-1] - start, lengths)
        grid[rows, cols] = self.keys[start : int(offs[-1])]
        return grid

    def rows(self, lo: int, hi: int) -> Columns:
        """Objects ``lo`` to ``hi`` (views of the buffers, new offsets)."""
        ko, io = self.key_offsets[lo : hi + 1], self.id_offsets[lo : hi + 1]
        keys, ids = self.keys[ko[0] : ko[-1]], self.ids[io[0] : io[-1]]
        return Columns(keys, ko - ko[0], self.sizes[lo:hi], ids, io - io[0])

    def head(self, k: int) -> Columns:
        """The first ``k`` objects (views, no copy)."""
        if k >= len(self):
            return self
        ko, io = self.key_offsets[: k + 1], self.id_offsets[: k + 1]
        return Columns(self.keys[: ko[-1]], ko, self.sizes[:k], self.ids[: io[-1]], io)

    def cut(self, n: int) -> Columns:
        """The same objects with the first ``n`` bytes of every key left out (a common prefix)."""
        if n == 0:
            return self
        count = len(self)
        width = int(self.key_offsets[1]) if count else 0
        if count and width >= n and bool((np.diff(self.key_offsets) == width).all()):  # keys of one length
            keys = np.array(self.keys.reshape(count, width)[:, n:], copy=True).reshape(-1)
            offsets = self.key_offsets - np.arange(count + 1) * n
            return Columns(keys, offsets, self.sizes, self.ids, self.id_offsets)
        keys, key_offsets = gather(self.keys, self.key_offsets[:-1] + n, self.key_offsets[1:])
        return Columns(keys, key_offsets, self.sizes, self.ids, self.id_offsets)

    @staticmethod
    def join(parts: Sequence[Columns]) -> Columns:
        """``parts`` one after the other."""
        if len(parts) == 1:
            return parts[0]
        grow = Growing()
        for part in parts:
            grow.add(part)
        return grow.done()


class _Array:
    """One array that grows in place: anonymous memory, mapped, grown by ``mremap`` (``mmap.resize``), so
    growing copies nothing and the room not yet filled takes no memory (its pages are not touched)."""

    __slots__ = ("cap", "dtype", "map", "n")

    def __init__(self, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.map: mmap.mmap | None = None
        self.n = self.cap = 0

    def add(self, values: npt.NDArray[Any], shift: int = 0) -> None:
        if not len(values):
            return
        need = self.n + len(values)
        size = self.dtype.itemsize
        if need > self.cap:
            self.cap = max(need, 2 * self.cap, _FIRST_BYTES // size)
            if self.map is None:
                # Private: a shared anonymous map is a file of fixed size, which mremap cannot grow.
                self.map = mmap.mmap(-1, self.cap * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            else:
                self.map.resize(self.cap * size)  # no view of it is alive (see done())
        dest = np.frombuffer(self.map, dtype=self.dtype, count=len(values), offset=self.n * size)  # type: ignore[arg-type]
        if shift:
            np.add(values, shift, out=dest)
        else:
            dest[...] = values
        del dest
        self.n = need

    def done(self) -> npt.NDArray[Any]:
        """The array (a view of the map, which it keeps alive); nothing is added after."""
        if self.map is None or not self.n:
            return np.zeros(0, dtype=self.dtype)
        self.map.resize(self.n * self.dtype.itemsize)
        out: npt.NDArray[Any] = np.frombuffer(self.map, dtype=self.dtype, count=self.n)  # type: ignore[arg-type]
        self.map = None
        return out


class Growing:
    """Pages of a listing appended as they arrive, in arrays that grow in place; :meth:`done` hands
    them over as one :class:`Columns` (the builder is empty afterwards)."""

    __slots__ = ("_id_offsets", "_ids", "_key_offsets", "_keys", "_sizes")

    def __init__(self) -> None:
        self._keys = _Array(np.uint8)
        self._ids = _Array(np.uint8)
        self._sizes = _Array(np.int64)
        self._key_offsets = _Array(np.int64)
        self._id_offsets = _Array(np.int64)
        self._key_offsets.add(np.zeros(1, np.int64))
        self._id_offsets.add(np.zeros(1, np.int64))

    def __len__(self) -> int:
        return self._sizes.n

    def add(self, part: Columns) -> None:
        if not len(part):
            return
        self._key_offsets.add(part.key_offsets[1:], self._keys.n - int(part.key_offsets[0]))
        self._id_offsets.add(part.id_offsets[1:], self._ids.n - int(part.id_offsets[0]))
        self._keys.add(part.keys[part.key_offsets[0] : part.key_offsets[-1]])
        self._ids.add(part.ids[part.id_offsets[0] : part.id_offsets[-1]])
        self._sizes.add(part.sizes)

    def done(self) -> Columns:
        return Columns(
            self._keys.done(), self._key_offsets.done(), self._sizes.done(), self._ids.done(),
            self._id_offsets.done(),
        )  # fmt: skip

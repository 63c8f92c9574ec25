"""The manifest: a compact, remembered table of the samples of one dataset folder.

A listing of 1.3M objects is kept as a handful of numpy arrays (never one Python object per
sample), so that DataLoader workers forked from the main process share its pages instead of
copying them as reference counts are touched. The on-disk form is a small binary layout, read
without pickle:

====================  =====================================================================
bytes 0-7             magic ``b"BLOBMANI"``
bytes 8-11            format version, uint32 little endian
bytes 12-19           header length in bytes, uint64 little endian
bytes 20-23           CRC-32 of every byte after the preamble (header, padding, arrays)
header                UTF-8 JSON: root, classes, count, listed_at, skipped, params, and the
                      offset/length/dtype of each array
arrays                ``keys`` (uint8), ``key_offsets`` (int64, n+1), ``sizes`` (int64),
                      ``targets`` (int32), ``ids`` (uint8), ``id_offsets`` (int64, n+1),
                      each at a 64-byte aligned offset from the start of the file
====================  =====================================================================

A local manifest is mapped read-only, not read (:mod:`blobdata._listing.mapping`): the processes of a
node share its pages, and its checksum is verified once per file and node.

Keys are stored as the UTF-8 bytes of the key relative to the root (``surrogatepass``, so any
``str`` round-trips, including the surrogate-escaped names os.walk yields for undecodable bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._config import cache_home
from .._errors import ManifestError
from .mapping import Buffer, is_verified, mark_verified, read_source, write_streamed
from .packed import pack, unpack, write_packed

__all__ = ["FORMAT_VERSION", "Manifest", "load_own", "manifest_path"]

FORMAT_VERSION = 1
_MAGIC = b"BLOBMANI"
_ENC = "utf-8"
_ERRORS = "surrogatepass"
# name -> dtype; the order is the order on disk.
_ARRAYS: dict[str, str] = {
    "keys": "uint8",
    "key_offsets": "<i8",
    "sizes": "<i8",
    "targets": "<i4",
    "ids": "uint8",
    "id_offsets": "<i8",
}


def _join(strings: Sequence[str]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Encode strings into one uint8 buffer and n+1 int64 offsets."""
    encoded = [s.encode(_ENC, _ERRORS) for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    if encoded:
        np.cumsum(np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
    buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return buf, offsets


def strings_at(buf: npt.NDArray[np.uint8], offs: npt.NDArray[np.int64], rows: Sequence[int]) -> list[str]:
    """The strings ``rows`` of a string buffer and its offsets (a batch's keys: one numpy gather for the
    offsets, one decode each)."""
    at = np.asarray(rows, dtype=np.int64)
    if at.size and (int(at.min()) < 0 or int(at.max()) >= len(offs) - 1):
        raise IndexError(f"rows {rows!r} out of range for {len(offs) - 1} entries")
    view = buf.data
    return [
        view[a:b].tobytes().decode(_ENC, _ERRORS)
        for a, b in zip(offs[at].tolist(), offs[at + 1].tolist(), strict=True)
    ]


def _decreases(offsets: npt.NDArray[np.int64]) -> bool:
    """Whether ``offsets`` ever decreases; in slices, so that a mapped manifest's check allocates
    little (a whole ``np.diff`` would be 8 bytes a sample of anonymous memory)."""
    step = 1 << 16
    return any(bool((np.diff(offsets[i : i + step + 1]) < 0).any()) for i in range(0, len(offsets) - 1, step))


def _u8(data: npt.ArrayLike | bytes) -> npt.NDArray[np.uint8]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(data, dtype=np.uint8)


class Manifest:
    """The samples of one dataset folder, in ImageFolder order.

    ``root`` is the canonical root URL (``str(parse_url(url))``), ``classes`` the sorted class
    names; ``sizes`` (int64, bytes) and ``targets`` (int32, class index) are numpy arrays indexed
    by sample. ``listed_at`` is the wall-clock time of the listing (seconds since the epoch);
    ``skipped`` the URLs of objects that could not belong to any class; ``params`` the listing
    parameters (extensions, ...) the manifest was made with.
    """

    __slots__ = (
        "_id_offsets",
        "_ids",
        "_key_offsets",
        "_keys",
        "_path",
        "_url_prefix",
        "classes",
        "listed_at",
        "params",
        "root",
        "sizes",
        "skipped",
        "targets",
    )

    def __init__(
        self,
        root: str,
        classes: Sequence[str],
        *,
        keys: npt.NDArray[np.uint8],
        key_offsets: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        targets: npt.NDArray[np.int32],
        ids: npt.NDArray[np.uint8],
        id_offsets: npt.NDArray[np.int64],
        listed_at: float,
        skipped: Sequence[str] = (),
        params: Mapping[str, Any] | None = None,
        _checked: bool = False,
    ) -> None:
        self.root = root
        self.classes = list(classes)
        self._keys = keys
        self._key_offsets = key_offsets
        self.sizes = sizes
        self.targets = targets
        self._ids = ids
        self._id_offsets = id_offsets
        self.listed_at = float(listed_at)
        self.skipped = list(skipped)
        self.params = dict(params or {})
        self._url_prefix = root + "/"
        self._path: str | None = None  # the local file it is mapped from, if it is
        problem = self._check(whole=not _checked)
        if problem:
            raise ManifestError(f"inconsistent manifest for {root}: {problem}", url=root)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_entries(
        cls,
        root: str,
        classes: Sequence[str],
        entries: Iterable[tuple[str, int, str, int]],
        *,
        listed_at: float,
        skipped: Sequence[str] = (),
        params: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Build from ``(relkey, size_bytes, identity, target)`` tuples, kept in the given order."""
        relkeys: list[str] = []
        identities: list[str] = []
        sizes: list[int] = []
        targets: list[int] = []
        for relkey, size, identity, target in entries:
            relkeys.append(relkey)
            sizes.append(size)
            identities.append(identity)
            targets.append(target)
        keys, key_offsets = _join(relkeys)
        ids, id_offsets = _join(identities)
        return cls(
            root,
            classes,
            keys=keys,
            key_offsets=key_offsets,
            sizes=np.asarray(sizes, dtype=np.int64),
            targets=np.asarray(targets, dtype=np.int32),
            ids=ids,
            id_offsets=id_offsets,
            listed_at=listed_at,
            skipped=skipped,
            params=params,
        )

    @classmethod
    def from_arrays(
        cls,
        root: str,
        classes: Sequence[str],
        *,
        keys: npt.ArrayLike | bytes,
        key_offsets: npt.ArrayLike,
        sizes: npt.ArrayLike,
        targets: npt.ArrayLike,
        ids: npt.ArrayLike | bytes,
        id_offsets: npt.ArrayLike,
        listed_at: float,
        skipped: Sequence[str] = (),
        params: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Build from ready arrays (UTF-8 buffers with n+1 offsets); validated, converted if needed."""
        return cls(
            root,
            classes,
            keys=_u8(keys),
            key_offsets=np.ascontiguousarray(key_offsets, dtype=np.int64),
            sizes=np.ascontiguousarray(sizes, dtype=np.int64),
            targets=np.ascontiguousarray(targets, dtype=np.int32),
            ids=_u8(ids),
            id_offsets=np.ascontiguousarray(id_offsets, dtype=np.int64),
            listed_at=listed_at,
            skipped=skipped,
            params=params,
        )

    def _check(self, whole: bool = True) -> str | None:
        """What is inconsistent in the arrays, or None. Without ``whole``, only what costs nothing per
        sample (a file this node already checked: every array is not read again)."""
        n = len(self.sizes)
        if self.sizes.ndim != 1 or self.targets.shape != (n,):
            return f"sizes {self.sizes.shape} and targets {self.targets.shape} must be 1-d of equal length"
        for name, buf, offs in (
            ("keys", self._keys, self._key_offsets),
            ("ids", self._ids, self._id_offsets),
        ):
            if offs.shape != (n + 1,):
                return f"{name} offsets must have {n + 1} entries, has {offs.shape}"
            if offs[0] != 0 or offs[-1] != len(buf) or (whole and n and _decreases(offs)):
                return f"{name} offsets do not describe the {len(buf)}-byte buffer"
        if list(self.classes) != sorted(set(self.classes)):
            return "classes are not sorted and unique"
        if not whole:
            return None
        if n and (int(self.targets.min()) < 0 or int(self.targets.max()) >= len(self.classes)):
            return f"targets outside 0..{len(self.classes) - 1}"
        if n and int(self.sizes.min()) < 0:
            return "negative object size"
        return None

    # -- access ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sizes)

    def __repr__(self) -> str:
        return f"Manifest({self.root!r}, {len(self)} samples, {len(self.classes)} classes)"

    def _index(self, i: int) -> int:
        n = len(self.sizes)
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"sample index {i} out of range for {n} samples of {self.root}")
        return j

    def relkey(self, i: int) -> str:
        """The key of sample ``i`` relative to ``root``, exactly as listed."""
        i = self._index(i)
        return self._keys[self._key_offsets[i] : self._key_offsets[i + 1]].tobytes().decode(_ENC, _ERRORS)

    def url(self, i: int) -> str:
        """``root + "/" + relkey``: the exact key, never normalised."""
        return self._url_prefix + self.relkey(i)

    @property
    def url_prefix(self) -> str:
        """What every :meth:`url` starts with: ``root + "/"``."""
        return self._url_prefix

    def urls(self, rows: Sequence[int]) -> list[str]:
        """:meth:`url` of each of ``rows`` (a batch at once)."""
        prefix = self._url_prefix
        return [prefix + k for k in strings_at(self._keys, self._key_offsets, rows)]

    def relkeys(self, rows: Sequence[int]) -> list[str]:
        """:meth:`relkey` of each of ``rows`` (a batch at once)."""
        return strings_at(self._keys, self._key_offsets, rows)

    def identities(self, rows: Sequence[int]) -> list[str]:
        """:meth:`identity` of each of ``rows`` (a batch at once)."""
        return strings_at(self._ids, self._id_offsets, rows)

    def identity(self, i: int) -> str:
        """ETag / generation / mtime-size string of sample ``i`` at listing time."""
        i = self._index(i)
        return self._ids[self._id_offsets[i] : self._id_offsets[i + 1]].tobytes().decode(_ENC, _ERRORS)

    def size(self, i: int) -> int:
        """Size of sample ``i`` in bytes at listing time."""
        return int(self.sizes[i])

    def target(self, i: int) -> int:
        """Class index of sample ``i``."""
        return int(self.targets[i])

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def class_counts(self) -> list[int]:
        """Number of samples of each class, in class order."""
        return [int(c) for c in np.bincount(self.targets, minlength=len(self.classes))]

    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def _arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {
            "keys": self._keys,
            "key_offsets": self._key_offsets,
            "sizes": self.sizes,
            "targets": self.targets,
            "ids": self._ids,
            "id_offsets": self._id_offsets,
        }

    # -- storage --------------------------------------------------------------------------

    def _header(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "root": self.root,
            "classes": self.classes,
            "count": len(self),
            "listed_at": self.listed_at,
            "skipped": self.skipped,
            "params": self.params,
        }

    def to_bytes(self) -> bytes:
        """The on-disk form (see the module docstring and :mod:`blobdata._listing.packed`)."""
        return pack(_MAGIC, FORMAT_VERSION, self._header(), self._arrays(), _ARRAYS)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a 0600 temp file in the same directory, fsync, then ``os.replace``; the
        arrays are written one after the other, never copied into one image of the file.

        Missing parent directories are created with mode 0700.
        """
        header = self._header()
        write_streamed(
            Path(path), lambda fh: write_packed(fh, _MAGIC, FORMAT_VERSION, header, self._arrays(), _ARRAYS)
        )

    @classmethod
    def from_bytes(cls, data: Buffer, *, source: str = "<bytes>", verified: bool = False) -> Manifest:
        """Parse the on-disk form (bytes, or a mapped file: the arrays are views of it); raise
        ManifestError naming ``source`` and what is wrong. ``verified``: the checksum and the arrays'
        checks already passed on this node (see :mod:`blobdata._listing.mapping`), so neither reads
        the arrays again."""

        def bad(what: str) -> ManifestError:
            return ManifestError(
                f"manifest {source} is unusable: {what}; delete it or list again with refresh=True",
                url=source,
            )

        header, arrays = unpack(
            data, magic=_MAGIC, version=FORMAT_VERSION, dtypes=_ARRAYS, kind="manifest", verified=verified,
            bad=bad,
        )  # fmt: skip
        try:
            root = header["root"]
            classes = header["classes"]
            count = header["count"]
            listed_at = float(header["listed_at"])
        except (ValueError, KeyError, TypeError) as exc:
            raise bad(f"corrupt header ({exc.__class__.__name__}: {exc})") from None
        if not (
            isinstance(root, str)
            and isinstance(classes, list)
            and all(isinstance(c, str) for c in classes)
            and isinstance(count, int)
        ):
            raise bad("header fields have the wrong types")
        if len(arrays["sizes"]) != count:
            raise bad(f"header says {count} samples, arrays hold {len(arrays['sizes'])}")
        try:
            return cls(
                root,
                classes,
                keys=arrays["keys"],
                key_offsets=arrays["key_offsets"],
                sizes=arrays["sizes"],
                targets=arrays["targets"],
                ids=arrays["ids"],
                id_offsets=arrays["id_offsets"],
                listed_at=listed_at,
                skipped=[str(s) for s in header.get("skipped") or []],
                params=header.get("params") if isinstance(header.get("params"), dict) else None,
                _checked=verified,
            )
        except ManifestError as exc:
            raise bad(exc.message.split(": ", 1)[-1]) from None

    @classmethod
    def load(
        cls,
        path_or_url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        expect_root: str | None = None,
        progress: bool | None = None,
    ) -> Manifest:
        """Read a manifest from a local path (mapped read-only, its checksum verified once per node:
        :mod:`blobdata._listing.mapping`) or a URL (s3://, gs://, az://, memory://; with a bar).

        ``expect_root``: the canonical root URL the manifest must be for (ManifestError otherwise).
        A missing file raises NotFound (or the error class of the store).
        """
        source = os.fspath(path_or_url)
        return cls._checked(source, *read_source(source, storage_options, progress), expect_root)

    @classmethod
    def _checked(cls, source: str, data: Buffer, mark: str | None, expect_root: str | None) -> Manifest:
        known = is_verified(mark)
        manifest = cls.from_bytes(data, source=source, verified=known)
        if not known:
            mark_verified(mark)
        if mark is not None:  # mapped from a local file
            manifest._path = source
        if expect_root is not None and manifest.root != expect_root:
            raise ManifestError(
                f"manifest {source} lists {manifest.root}, not {expect_root}: pass the manifest made for "
                f"{expect_root} (blobdata ls {expect_root} --save PATH) or none",
                url=source,
            )
        return manifest


def load_own(path: str | os.PathLike[str], *, setting: str, expect_root: str | None = None) -> Manifest:
    """:meth:`Manifest.load` of a file in a place shared on the node (a remembered listing, a rank's
    hand-off): mapped only if it is this user's own, not a link, in a directory no one else can write
    (ConfigError otherwise, naming ``setting``, what chose the place), the descriptor checked being the
    one mapped (:func:`~blobdata._listing.mapping.read_source`)."""
    source = os.fspath(path)
    return Manifest._checked(source, *read_source(source, None, False, own=setting), expect_root)


def manifest_path(root: str, options_token: str, params: Mapping[str, Any] | None = None) -> Path:
    """Where the listing of ``root`` is remembered: ``cache_home()/manifests/<sha256>.manifest``.

    The name hashes the canonical root URL, the storage options token (which may hold secrets,
    hence only its hash is on disk) and the listing parameters, so that another endpoint, other
    credentials or other extensions never reuse a listing.
    """
    h = hashlib.sha256()
    for part in (root, options_token, json.dumps(dict(params or {}), sort_keys=True, default=repr)):
        h.update(part.encode(_ENC, _ERRORS))
        h.update(b"\x00")
    return cache_home() / "manifests" / f"{h.hexdigest()[:40]}.manifest"

"""Samples of several objects: webdataset's key rule, and the table a :class:`~blobdata.BlobDataset` reads.

The key rule (webdataset's ``base_plus_ext``): an object's key is its path relative to the dataset root
up to the first dot of its base name, and the rest is the member's name, so ``a/x.seg.png`` is member
``seg.png`` of sample ``a/x``. A name with no dot after its first character (``README``,
``.hidden``) belongs to no sample. Samples are sorted by key (code point order); a sample's members
by name.

The table is a few numpy arrays (no Python object per sample, so forked DataLoader workers share its
pages): one row per *object* in sample order (key relative to the root, size, identity, the member's
name), ``offsets`` giving each sample's rows, each sample's key, and its fields (the extra columns of a
metadata or index file) as one JSON text per sample, parsed only when the sample is read. A size of
``-1`` or an identity of ``""`` is not known yet (an index without them): learned at the first read.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from .manifest import _join, strings_at

__all__ = ["Member", "SampleTable", "split_key"]

_ENC, _ERRORS = "utf-8", "surrogatepass"


def split_key(relkey: str) -> tuple[str, str] | None:
    """``(sample key, member name)`` by webdataset's rule, or None for a name with no extension."""
    head, sep, base = relkey.rpartition("/")
    dot = base.find(".", 1) if not base.startswith(".") else -1
    if dot <= 0 or dot == len(base) - 1:
        return None
    return head + sep + base[:dot], base[dot + 1 :]


class Member(NamedTuple):
    """One object of a sample: its key relative to the root, size (-1: unknown), identity ("": unknown),
    the member's name (a name ending in ``[]`` collects its objects into a list), and the line (or row) of
    the metadata or index file that named it, for error messages (0 for a listing)."""

    relkey: str
    size: int
    identity: str
    name: str
    where: int = 0


def _strings(buf: npt.NDArray[np.uint8], offs: npt.NDArray[np.int64], i: int) -> str:
    return buf[offs[i] : offs[i + 1]].tobytes().decode(_ENC, _ERRORS)


class SampleTable:
    """The samples of a :class:`~blobdata.BlobDataset`: see the module docstring."""

    __slots__ = (
        "_fields",
        "_fields_off",
        "_ids",
        "_ids_off",
        "_keys",
        "_keys_off",
        "_names",
        "_names_off",
        "_rel",
        "_rel_off",
        "_where",
        "_where_fmt",
        "listing",
        "offsets",
        "root",
        "sizes",
    )

    def __init__(
        self,
        root: str,
        samples: Sequence[tuple[str, Sequence[Member], Mapping[str, Any] | None]],
        *,
        where: str = "",
    ) -> None:
        """``samples``: ``(key, members, fields)`` in the order to keep (callers sort by key); ``where``
        names a member's line in the file that named it (``"index x.csv line {}"``)."""
        self.root = root
        self.listing: Any = None  # the folder's listing (a Manifest) the table was made from, if any
        members = [m for _, ms, _ in samples for m in ms]
        self._rel, self._rel_off = _join([m.relkey for m in members])
        self._ids, self._ids_off = _join([m.identity for m in members])
        self._names, self._names_off = _join([m.name for m in members])
        self._where = np.asarray([m.where for m in members], dtype=np.int64) if where else None
        self._where_fmt = where
        self.sizes = np.asarray([m.size for m in members], dtype=np.int64)
        counts = np.fromiter((len(ms) for _, ms, _ in samples), dtype=np.int64, count=len(samples))
        self.offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self._keys, self._keys_off = _join([k for k, _, _ in samples])
        self._fields, self._fields_off = _join(
            [
                json.dumps(dict(f), ensure_ascii=False, separators=(",", ":")) if f else ""
                for _, _, f in samples
            ]
        )

    #: The arrays of a table, in their order on disk (:mod:`blobdata._listing.tablefile`), and their dtypes.
    ARRAYS: ClassVar[dict[str, str]] = {
        "keys": "uint8", "keys_off": "<i8", "offsets": "<i8", "fields": "uint8", "fields_off": "<i8",
        "rel": "uint8", "rel_off": "<i8", "sizes": "<i8", "ids": "uint8", "ids_off": "<i8",
        "names": "uint8", "names_off": "<i8", "where": "<i8",
    }  # fmt: skip

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """Everything the table holds, as arrays (``where`` empty when no file named the rows)."""
        where = self._where if self._where is not None else np.zeros(0, dtype=np.int64)
        return {
            "keys": self._keys, "keys_off": self._keys_off, "offsets": self.offsets,
            "fields": self._fields, "fields_off": self._fields_off, "rel": self._rel,
            "rel_off": self._rel_off, "sizes": self.sizes, "ids": self._ids, "ids_off": self._ids_off,
            "names": self._names, "names_off": self._names_off, "where": where,
        }  # fmt: skip

    @property
    def where_template(self) -> str:
        return self._where_fmt

    @classmethod
    def from_arrays(
        cls, root: str, arrays: Mapping[str, npt.NDArray[Any]], *, where: str = ""
    ) -> SampleTable:
        """A table from :meth:`arrays`' output (views are kept, not copied); ValueError says what is
        inconsistent."""
        t = cls.__new__(cls)
        t.root, t.listing, t._where_fmt = root, None, where
        t._keys, t._keys_off, t.offsets = arrays["keys"], arrays["keys_off"], arrays["offsets"]
        t._fields, t._fields_off = arrays["fields"], arrays["fields_off"]
        t._rel, t._rel_off, t.sizes = arrays["rel"], arrays["rel_off"], arrays["sizes"]
        t._ids, t._ids_off = arrays["ids"], arrays["ids_off"]
        t._names, t._names_off = arrays["names"], arrays["names_off"]
        t._where = arrays["where"] if where else None
        n, m = len(t.offsets) - 1, len(t.sizes)
        if n < 0 or t.offsets[0] != 0 or t.offsets[-1] != m or (n and bool((np.diff(t.offsets) <= 0).any())):
            raise ValueError("sample offsets do not describe the object rows (every sample has a member)")
        for name, buf, offs, count in (
            ("keys", t._keys, t._keys_off, n), ("fields", t._fields, t._fields_off, n),
            ("object keys", t._rel, t._rel_off, m), ("identities", t._ids, t._ids_off, m),
            ("member names", t._names, t._names_off, m),
        ):  # fmt: skip
            bad = len(offs) != count + 1 or offs[0] != 0 or offs[-1] != len(buf)
            if bad or bool((np.diff(offs) < 0).any()):
                raise ValueError(f"{name}' offsets do not describe their {len(buf)}-byte buffer")
        if m and int(t.sizes.min()) < -1:
            raise ValueError("an object size below -1 (-1 is: not known)")
        if t._where is not None and len(t._where) != m:
            raise ValueError(f"{len(t._where)} row numbers for {m} objects")
        return t

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_objects(self) -> int:
        return len(self.sizes)

    def key(self, i: int) -> str:
        return _strings(self._keys, self._keys_off, i)

    def keys(self, indices: Sequence[int]) -> list[str]:
        """:meth:`key` of each of ``indices`` (a batch at once)."""
        return strings_at(self._keys, self._keys_off, indices)

    def members(self, i: int) -> range:
        """The object rows of sample ``i``."""
        return range(int(self.offsets[i]), int(self.offsets[i + 1]))

    def relkey(self, j: int) -> str:
        return _strings(self._rel, self._rel_off, j)

    def url(self, j: int) -> str:
        return self.root + "/" + self.relkey(j)

    def identity(self, j: int) -> str:
        return _strings(self._ids, self._ids_off, j)

    def urls(self, rows: Sequence[int]) -> list[str]:
        """:meth:`url` of each object row of ``rows`` (a batch at once)."""
        prefix = self.root + "/"
        return [prefix + k for k in strings_at(self._rel, self._rel_off, rows)]

    def identities(self, rows: Sequence[int]) -> list[str]:
        """:meth:`identity` of each object row of ``rows`` (a batch at once)."""
        return strings_at(self._ids, self._ids_off, rows)

    def name(self, j: int) -> str:
        return _strings(self._names, self._names_off, j)

    def where(self, j: int) -> str:
        """Where object row ``j`` was named (a metadata or index file and line), or ""."""
        return self._where_fmt.format(int(self._where[j])) if self._where is not None else ""

    def fields(self, i: int) -> dict[str, Any]:
        text = _strings(self._fields, self._fields_off, i)
        return dict(json.loads(text)) if text else {}

    def sample_bytes(self, i: int) -> int:
        """Bytes sample ``i`` reads, as far as known (unknown sizes count 0)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return int(np.clip(self.sizes[a:b], 0, None).sum())


def group_listing(
    root: str, entries: Iterable[tuple[str, int, str]], *, skip: Iterable[str] = ()
) -> tuple[list[tuple[str, list[Member], None]], list[str]]:
    """Listed objects grouped into samples by the key rule, sorted; also the objects left out (no
    extension, folder markers, ``skip``)."""
    drop = set(skip)
    groups: dict[str, list[Member]] = {}
    left: list[str] = []
    for relkey, size, ident in entries:
        split = None if relkey.endswith("/") or relkey in drop else split_key(relkey)
        if split is None:
            if not relkey.endswith("/"):
                left.append(relkey)
            continue
        key, name = split
        groups.setdefault(key, []).append(Member(relkey, size, ident, name))
    out: list[tuple[str, list[Member], None]] = []
    for key in sorted(groups):
        ms = sorted(groups[key], key=lambda m: m.name)
        for a, b in itertools.pairwise(ms):
            if a.name == b.name:  # only where two spellings of a key list the same (a store's quirk)
                raise ConfigError(
                    f"sample {key!r} of {root} has two objects for member {a.name!r}: {root}/{a.relkey} and "
                    f"{root}/{b.relkey}; rename one",
                    url=f"{root}/{a.relkey}",
                )
        out.append((key, ms, None))
    return out, left


def relative_key(value: Any, root: str, where: object, column: str) -> str:
    """An object named by a metadata or index row, as a key relative to ``root``: a relative path, or a
    URL below ``root``; anything outside ``root`` (``..``, an absolute path, another URL) is refused."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: column {column!r} must name an object, got {value!r}", url=root)
    text = value
    if (  # the common case, without splitting
        "://" not in text
        and ".." not in text
        and "//" not in text
        and "/./" not in text
        and "\x00" not in text
        and "\\" not in text
        and not text.startswith(("/", "./"))
        and not text.endswith(("/", "/."))
        and text != "."
    ):
        return text
    if "://" in text:
        if not text.startswith(root + "/"):
            raise ConfigError(
                f"{where}: {column} {value!r} is outside the dataset's URL {root}: name objects relative "
                "to it (a row may name only objects below it)",
                url=value,
            )
        text = text[len(root) + 1 :]
    parts = text.split("/")
    if text.startswith("/") or "\x00" in text or "\\" in text or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(
            f"{where}: {column} {value!r} is outside the dataset's URL {root} or not a plain relative key "
            "(no leading '/', no '.', '..' or empty segments): name objects relative to it",
            url=root,
        )
    return text

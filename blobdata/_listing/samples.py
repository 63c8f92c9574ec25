"""Samples of several objects: webdataset's key rule, and the table a :class:`~blobdata.BlobDataset` reads.

The key rule (webdataset's ``base_plus_ext``): an object's key is its path relative to the dataset root
up to the first dot of its base name, and the rest, lower-cased (webdataset's ``lcase``), is the member's
name, so ``a/x.seg.PNG`` is member ``seg.png`` of sample ``a/x``; two objects whose names differ only in
case (``x.JPG``, ``x.jpg``) are refused, as webdataset refuses them. A name with no dot after its first
character (``README``, ``.hidden``) belongs to no sample, and so, in a listing, does an object in a
hidden (``.x/``) or special (``__x/``) folder, which Hugging Face skips (``__MACOSX/``,
``.ipynb_checkpoints/``). Samples are sorted by key (code point order); a sample's members by name.

The table is a few numpy arrays (no Python object per sample, so forked DataLoader workers share its
pages): one row per *object* in sample order (key relative to the root, size, identity, the member's
name), ``offsets`` giving each sample's rows, each sample's key, and its fields (the extra columns of a
metadata or index file) as one JSON text per sample, parsed only when the sample is read (values JSON
has no type for, a Parquet file's timestamps, dates, times, durations, decimals and bytes, are kept
tagged and given back as pyarrow gives them). A size of ``-1`` or an identity of ``""`` is not known
yet (an index without them): learned at the first read.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    return head + sep + base[:dot], base[dot + 1 :].lower()


def in_hidden_folder(relkey: str) -> bool:
    """Whether ``relkey`` lies in a folder whose name starts with ``.`` or ``__`` (below the root), which
    Hugging Face's folder loaders skip."""
    if "/." not in relkey and "/__" not in relkey and not relkey.startswith((".", "__")):
        return False  # the common case, without splitting
    return any(p.startswith((".", "__")) for p in relkey.split("/")[:-1])


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
            [_encode(k, f, ms, where) if f else "" for k, ms, f in samples]
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
        if not text:
            return {}
        if text[0] == _TAGGED:
            return dict(json.loads(text[1:], object_hook=_revive))
        return dict(json.loads(text))

    def sample_bytes(self, i: int) -> int:
        """Bytes sample ``i`` reads, as far as known (unknown sizes count 0)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return int(np.clip(self.sizes[a:b], 0, None).sum())


# -- fields: JSON, and tagged values for what JSON has no type for --------------------------------
# A sample's fields are one JSON text. When a value has no JSON type (a Parquet file's timestamp, date,
# time, duration, decimal or bytes), the text starts with _TAGGED and each such value is an object
# {_TAG: kind, "v": text}; an object of the data that has a _TAG key of its own is kept as
# {_TAG: "dict", "v": [[key, value], ...]}, so no value of the data is ever read as a tag.
_TAGGED, _TAG = "\x01", "\x00blobdata"
_KINDS: dict[type, tuple[str, Callable[[Any], Any]]] = {
    datetime.datetime: ("datetime", datetime.datetime.isoformat),
    datetime.date: ("date", datetime.date.isoformat),
    datetime.time: ("time", datetime.time.isoformat),
    datetime.timedelta: ("timedelta", lambda v: [v.days, v.seconds, v.microseconds]),
    decimal.Decimal: ("decimal", str),
    bytes: ("bytes", lambda v: base64.b64encode(v).decode("ascii")),
}
_REVIVE: dict[str, Callable[[Any], Any]] = {
    "datetime": datetime.datetime.fromisoformat,
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "timedelta": lambda v: datetime.timedelta(days=v[0], seconds=v[1], microseconds=v[2]),
    "decimal": decimal.Decimal,
    "bytes": base64.b64decode,
    "dict": dict,
}


def _encode(key: str, fields: Mapping[str, Any], members: Sequence[Member], where: str) -> str:
    try:
        return json.dumps(dict(fields), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        pass  # a value JSON has no type for (or a circular one): tagged below, or refused
    try:
        return _TAGGED + json.dumps(_tagged(fields), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        place = where.format(members[0].where) if where and members else f"sample {key!r}"
        raise ConfigError(
            f"{place}: a field of sample {key!r} cannot be kept ({exc}); blobdata keeps JSON values, "
            "timestamps, dates, times, durations, decimals and bytes",
            url=place,
        ) from None


def _tagged(value: Any) -> Any:
    t = type(value)
    if t is dict:
        out = {k: _tagged(v) for k, v in value.items()}
        return {_TAG: "dict", "v": [[k, v] for k, v in out.items()]} if _TAG in value else out
    if t is list or t is tuple:
        return [_tagged(v) for v in value]
    kind = _KINDS.get(t) or next((k for c, k in _KINDS.items() if isinstance(value, c)), None)
    if kind is None:
        return value  # JSON's own (or refused by json.dumps)
    return {_TAG: kind[0], "v": kind[1](value)}


def _revive(obj: dict[str, Any]) -> Any:
    kind = obj.get(_TAG)
    if kind is None or len(obj) != 2:
        return obj
    return _REVIVE[kind](obj["v"])


def group_listing(
    root: str, entries: Iterable[tuple[str, int, str]], *, skip: Iterable[str] = ()
) -> tuple[list[tuple[str, list[Member], None]], list[str], list[str]]:
    """Listed objects grouped into samples by the key rule, sorted; also the objects left out: those
    with no extension (and folder markers, ``skip``), and those in hidden or special folders."""
    drop = set(skip)
    groups: dict[str, list[Member]] = {}
    left: list[str] = []
    hidden: list[str] = []
    for relkey, size, ident in entries:
        split = None if relkey.endswith("/") or relkey in drop else split_key(relkey)
        if split is None:
            if not relkey.endswith("/"):
                left.append(relkey)
            continue
        if in_hidden_folder(relkey):
            hidden.append(relkey)
            continue
        key, name = split
        groups.setdefault(key, []).append(Member(relkey, size, ident, name))
    out: list[tuple[str, list[Member], None]] = []
    for key in sorted(groups):
        ms = sorted(groups[key], key=lambda m: m.name)
        for a, b in itertools.pairwise(ms):
            if a.name == b.name:
                raise ConfigError(
                    f"sample {key!r} of {root} has two objects for member {a.name!r}: {root}/{a.relkey} and "
                    f"{root}/{b.relkey}; {same_member(a.relkey, b.relkey)}",
                    url=f"{root}/{a.relkey}",
                )
        out.append((key, ms, None))
    return out, left, hidden


def same_member(a: str, b: str) -> str:
    """What to say of two objects that are one member of one sample."""
    if a != b and a.lower() == b.lower():
        return (
            "their names differ only in case, and a member's name is its extension lower-cased (as "
            "webdataset reads it, which refuses such a pair too): rename or remove one"
        )
    return "rename one"  # two spellings of one key that a store lists alike


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

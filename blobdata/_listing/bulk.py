"""A listing made a manifest in bulk: ImageFolder's rules applied to the columns a lister returns
(:class:`~blobdata._stores.Columns`) with numpy, never a Python object per object (but for a user's
``is_valid_file``, called per object as torchvision calls it).

- :func:`with_extensions`: ImageFolder's default rule (not a folder marker, and the lower-cased key
  ends with one of the extensions), on every key at once; keys with a non-ASCII byte, whose
  ``str.lower()`` may change more than ASCII letters, are tested one by one.
- :func:`walk_sorted` / :func:`key_sorted`: the order of ``sorted(os.walk(...))`` with ``sorted(fnames)``
  (by ``(directory, name)``), or by key. A store lists in key order, so the keys are first checked to be
  in order already (in slices, a grid of a few thousand keys at a time): then nothing is copied. Else
  they are sorted as fixed-width byte strings (the last ``/`` of each key made the lowest byte, so that
  a directory sorts before its longer neighbours, as the ``(directory, name)`` tuples do), or, for keys
  with a byte below 2 or too long to grid, by Python's sort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from .._stores import Columns

__all__ = ["key_sorted", "starting_with", "valid_by", "walk_sorted", "with_extensions"]

_ROWS = 16_384  # keys per slice of the checks
_GRID_BYTES = 1 << 28  # the most a sort's grid may take; past it, Python's sort


def _slices(n: int) -> range:
    return range(0, n, _ROWS)


def _count(buf: npt.NDArray[np.uint8], below: int, value: int | None = None) -> int:
    """How many bytes of ``buf`` are ``value`` (or, without one, below ``below``), a slice at a time (no
    temporary the size of the buffer)."""
    step = 1 << 20
    if value is not None:
        return sum(int(np.count_nonzero(buf[i : i + step] == value)) for i in range(0, len(buf), step))
    return sum(int(np.count_nonzero(buf[i : i + step] < below)) for i in range(0, len(buf), step))


def _non_ascii(objects: Columns) -> npt.NDArray[np.int64]:
    """The keys holding a byte >= 0x80."""
    if not objects.keys.size or int(objects.keys.max()) < 0x80:  # a reduction: no temporary
        return np.zeros(0, dtype=np.int64)
    high = np.flatnonzero(objects.keys >= 0x80)
    return np.unique(np.searchsorted(objects.key_offsets, high, side="right") - 1)


def with_extensions(objects: Columns, extensions: tuple[str, ...]) -> npt.NDArray[np.bool_]:
    """Which keys ImageFolder keeps: ``not key.endswith("/") and key.lower().endswith(extensions)``."""
    n = len(objects)
    keep = np.zeros(n, dtype=bool)
    suffixes = [np.frombuffer(e.encode("utf-8", "surrogatepass"), np.uint8) for e in extensions]
    width = max([len(x) for x in suffixes] + [1])
    ends, lengths = objects.key_offsets[1:], np.diff(objects.key_offsets)
    buf = objects.keys if len(objects.keys) else np.zeros(1, dtype=np.uint8)
    for lo in _slices(n):
        e, length = ends[lo : lo + _ROWS], lengths[lo : lo + _ROWS]
        # The last ``width`` bytes of each key, ASCII lower-cased (a short key's are masked by its length).
        tail = buf[np.maximum(e[:, None] - width + np.arange(width), 0)]
        tail += ((tail >= 65) & (tail <= 90)).view(np.uint8) * np.uint8(32)
        hit = np.zeros(len(e), dtype=bool)
        for suffix in suffixes:
            k = len(suffix)
            hit |= (length >= k) & (tail[:, width - k :] == suffix).all(axis=1) if k else True
        marker = (length > 0) & (buf[np.maximum(e - 1, 0)] == 47)
        keep[lo : lo + _ROWS] = hit & ~marker
    for i in _non_ascii(objects).tolist():  # str.lower() beyond ASCII: as torchvision computes it
        key = objects.key(i)
        keep[i] = not key.endswith("/") and key.lower().endswith(extensions)
    return keep


def valid_by(objects: Columns, check: Callable[[str, str], bool], prefix: str) -> npt.NDArray[np.bool_]:
    """Which keys ``check(key, prefix + key)`` keeps (a user's ``is_valid_file``: one call per object)."""
    return np.fromiter((check(k, prefix + k) for k in objects.key_list()), dtype=bool, count=len(objects))


def starting_with(objects: Columns, head: bytes) -> npt.NDArray[np.bool_]:
    """Which keys start with ``head`` and are not folder markers (end with "/")."""
    n, k = len(objects), len(head)
    keep = np.zeros(n, dtype=bool)
    starts, lengths = objects.key_offsets[:-1], np.diff(objects.key_offsets)
    last = max(len(objects.keys) - 1, 0)
    if not len(objects.keys):
        return keep
    want = np.frombuffer(head, np.uint8)
    for lo in _slices(n):
        s, length = starts[lo : lo + _ROWS], lengths[lo : lo + _ROWS]
        got = objects.keys[np.clip(s[:, None] + np.arange(k), 0, last)]
        marker = objects.keys[np.clip(s + length - 1, 0, last)] == 47
        keep[lo : lo + _ROWS] = (length > k) & (got == want).all(axis=1) & ~marker
    return keep


def _increasing(objects: Columns) -> bool:
    """Whether every key is above the one before it (by bytes; no key may hold a NUL byte)."""
    n = len(objects)
    for lo in _slices(n - 1):
        grid = objects.grid(lo, min(lo + _ROWS + 1, n))
        a, b = grid[:-1], grid[1:]
        differ = a != b
        col = differ.argmax(axis=1)
        at = np.arange(len(col))
        if not bool((differ[at, col] & (a[at, col] < b[at, col])).all()):
            return False
    return True


def _permutation(objects: Columns, by: Callable[[str], Any]) -> npt.NDArray[np.int64] | None:
    """The order of the rows (no NUL byte), or of ``by(key)`` where a grid won't do; None: in order."""
    if not len(objects.keys) or _increasing(objects):
        return None
    width = max(int(np.diff(objects.key_offsets).max()), 1)
    if len(objects) * width <= _GRID_BYTES:
        return np.argsort(objects.grid().view(f"S{width}").ravel(), kind="stable").astype(np.int64)
    keys = objects.key_list()
    return np.array(sorted(range(len(keys)), key=lambda i: by(keys[i])), dtype=np.int64)


def _walk_key(key: str) -> tuple[str, str]:
    head, _, tail = key.rpartition("/")
    return head, tail


def walk_sorted(objects: Columns, common: str = "") -> Columns:
    """``objects`` in ImageFolder's order: by ``(directory, name)``, as ``sorted(os.walk(...))`` with
    ``sorted(fnames)`` gives them. ``common``: a directory every key lies in (``"cls/"``), if known."""
    n = len(objects)
    if n < 2:
        return objects
    head = common.encode("utf-8", "surrogatepass")
    if (
        head.endswith(b"/")
        and objects.key_bytes(0).startswith(head)
        and objects.key_bytes(n - 1).startswith(head)
        and _count(objects.keys, 0, 47) == n * head.count(b"/")
        and not _count(objects.keys, 1)
        and _increasing(objects)
    ):
        return objects  # in key order, which starts every key with ``head``: one directory, sorted names
    slashes = np.flatnonzero(objects.keys == 47)
    owner = np.searchsorted(objects.key_offsets, slashes, side="right") - 1
    last = np.flatnonzero(np.append(owner[1:] != owner[:-1], True)) if len(owner) else owner
    if len(last) < n or _count(objects.keys, 2):  # a key without a directory, or a byte below 2
        keys = objects.key_list()
        return objects.take(np.array(sorted(range(n), key=lambda i: _walk_key(keys[i])), dtype=np.int64))
    # The last '/' of each key as byte 1: below every other byte, above the padding.
    marked = objects.keys.copy()
    marked[slashes[last]] = 1
    del slashes, owner, last
    view = Columns(marked, objects.key_offsets, objects.sizes, objects.ids, objects.id_offsets)
    order = _permutation(view, lambda k: _walk_key(k.replace("\x01", "/")))
    return objects if order is None else objects.take(order)


def key_sorted(objects: Columns) -> Columns:
    """``objects`` by key (keys with a NUL byte: by Python's sort)."""
    if len(objects) < 2:
        return objects
    if _count(objects.keys, 1):
        keys = objects.key_list()
        return objects.take(np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64))
    order = _permutation(objects, lambda k: k)
    return objects if order is None else objects.take(order)

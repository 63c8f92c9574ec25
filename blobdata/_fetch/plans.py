"""Plans: each epoch's batches, published by the training process for the processes that serve them.

:class:`PlanChannel` is a private directory in the node's shared memory (:mod:`blobdata._node`)
holding the current epoch's plan (``plan.npy``) and, where it is known before it begins, the next
epoch's (``next.npy``): int64 arrays of the batches (offsets, then indices) and the augmentation seed
their batches carry. Written atomically, read without pickle, checked for shape before use.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _process
from .._node import shm
from .packed import PackedBatches

__all__ = ["Plan", "PlanChannel", "sweep_dead_channels"]


class Plan:
    """One epoch's batches: ``flat`` indices, ``offsets``; batch k is ``flat[offsets[k]:offsets[k+1]]``.
    ``next``: the next epoch's batches where they are known before it begins (persistent workers);
    ``seed``: the augmentation seed its batches carry (:class:`KeyedBatch`), where known."""

    def __init__(
        self,
        seq: int,
        flat: np.ndarray,
        offsets: np.ndarray,
        next: Plan | None = None,
        seed: int | None = None,
    ) -> None:
        self.seq = seq
        self.flat = flat
        self.offsets = offsets
        self.next = next
        self.seed = seed
        self._pos: np.ndarray | None = None

    def same_batches(self, other: Plan) -> bool:
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.flat, other.flat)

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1

    def locate(self, indices: Sequence[int]) -> int | None:
        """The batch number whose indices are exactly ``indices``, or None."""
        if not len(indices) or not len(self.flat):
            return None
        if self._pos is None:
            size = int(self.flat.max()) + 1
            pos = np.full(size, -1, dtype=np.int64)
            # Repeated indices (samplers with replacement) keep their first position.
            pos[self.flat[::-1]] = np.arange(len(self.flat) - 1, -1, -1, dtype=np.int64)
            self._pos = pos
        first = int(indices[0])
        if first < 0 or first >= len(self._pos) or self._pos[first] < 0:
            return None
        k = int(np.searchsorted(self.offsets, self._pos[first], side="right")) - 1
        for cand in (k, k + 1):  # a repeated index may sit at the end of an earlier batch
            if 0 <= cand < self.num_batches:
                batch = self.flat[self.offsets[cand] : self.offsets[cand + 1]]
                if len(batch) == len(indices) and np.array_equal(batch, np.asarray(indices, dtype=np.int64)):
                    return cand
        return self._among_repeats(first, indices)

    def _among_repeats(self, first: int, indices: Sequence[int]) -> int | None:
        """The batch ``indices`` where its first index is read more than once in the epoch (a
        mixture's source read more than its size): among the batches that begin with it."""
        starts = self.flat[np.minimum(self.offsets[:-1], len(self.flat) - 1)]
        want = np.asarray(indices, dtype=np.int64)
        for cand in np.flatnonzero(starts == first).tolist():
            if np.array_equal(self.flat[self.offsets[cand] : self.offsets[cand + 1]], want):
                return int(cand)
        return None

    def batch(self, k: int) -> np.ndarray:
        return self.flat[self.offsets[k] : self.offsets[k + 1]]


def _remove_if_owner(path: str, pid: int, lock: int) -> None:
    # Forked workers inherit the finalizer; only the creating process may remove the directory.
    if _process.pid() == pid:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)  # the owner's lock (_node.owners.hold), held until the directory is gone


#: Plan channels in the node's shared directory: ``plan-<pid>-<random>`` (:mod:`blobdata._node`).
_PLAN_KIND = "plan"


def sweep_dead_channels(parent: str | None = None) -> list[str]:
    """Remove the plan directories of this user's loaders whose process is gone (one killed by
    SIGKILL could not remove its own, and ``/dev/shm`` is memory): those whose owner lock can be taken
    (:mod:`blobdata._node`), and those an older blobdata left in ``/dev/shm`` itself
    (``blobdata-plan-<pid>-*``, judged by pid). Returns the paths removed."""
    removed = shm.sweep(_PLAN_KIND, parent)
    if parent is None:
        removed += shm.sweep("blobdata-plan", shm.shm_root())
    return removed


class PlanChannel:
    """A private directory through which the main process publishes plans to worker processes.

    Pickles as its path, so fork, spawn and forkserver workers (persistent or not) all see each new
    epoch's plan. The directory (mode 0700) is removed when the publishing object is collected or the
    interpreter exits; those of loaders that died without removing theirs are swept when a new
    channel is made (:func:`sweep_dead_channels`).
    """

    def __init__(self, path: str | None = None) -> None:
        self._owner = path is None
        if path is None:
            path, lock = shm.make_locked_dir(_PLAN_KIND)  # dead loaders' channels are swept first
            self._finalizer: Any = weakref.finalize(self, _remove_if_owner, path, _process.pid(), lock)
        self.path = path
        self._seq = 0
        self._cached: Plan | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (PlanChannel, (self.path,))

    def publish(self, batches: Sequence[Sequence[int]], seed: int | None = None) -> Plan:
        """Write one epoch's plan (its batches, and the augmentation seed they carry) atomically;
        workers pick it up on their next batch."""
        offsets, flat = _pack(batches)
        self._seq += 1
        seq = self._seq
        self._write("plan.npy", _blob(seq, offsets, flat, seed))
        plan = Plan(seq, flat, offsets, seed=seed)
        self._cached = plan
        return plan

    def publish_next(self, seq: int, batches: Sequence[Sequence[int]], seed: int | None = None) -> None:
        """Write the batches of the epoch after plan ``seq`` (where they are known before it begins)
        and the augmentation seed they will carry; workers read them when their look-ahead reaches
        plan ``seq``'s end (:meth:`next_of`)."""
        offsets, flat = _pack(batches)
        self._write("next.npy", _blob(seq, offsets, flat, seed))

    def next_of(self, plan: Plan) -> Plan | None:
        """The next epoch's batches announced for ``plan``, read once published; None until then."""
        if plan.next is None:
            got = self._read("next.npy")
            if got is not None and got.seq == plan.seq:
                plan.next = Plan(-plan.seq, got.flat, got.offsets, seed=got.seed)
        return plan.next

    def _write(self, name: str, blob: np.ndarray) -> None:
        tmp = os.path.join(self.path, f".{name}-{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, blob, allow_pickle=False)
        os.replace(tmp, os.path.join(self.path, name))

    def _read(self, name: str) -> Plan | None:
        try:
            with open(os.path.join(self.path, name), "rb") as fh:
                blob = np.load(fh, allow_pickle=False)
        except (OSError, ValueError):
            return None
        if blob.dtype != np.int64 or blob.ndim != 1 or len(blob) < 5:
            return None
        got = _unpack(blob, 2, int(blob[1]))
        if got is None or got[2] + 2 != len(blob) or blob[-2] not in (0, 1):
            return None
        seed = int(blob[-1:].view(np.uint64)[0]) if blob[-2] == 1 else None
        return Plan(int(blob[0]), got[1], got[0], seed=seed)

    def current(self, *, reload: bool = False) -> Plan | None:
        """The latest plan (cached in this process until ``reload``); None if none was published."""
        if self._cached is not None and not reload:
            return self._cached
        got = self._read("plan.npy")
        if got is not None and (self._cached is None or self._cached.seq != got.seq):
            self._cached = got
        return self._cached


def _pack(batches: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(batches, PackedBatches):
        return batches.offsets, batches.flat
    lengths = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
    offsets = np.zeros(len(batches) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    try:  # ints (or numpy ints) as they are: no Python call per index
        flat = np.fromiter(itertools.chain.from_iterable(batches), dtype=np.int64, count=int(offsets[-1]))
    except (TypeError, ValueError, OverflowError):
        flat = np.fromiter((int(i) for b in batches for i in b), dtype=np.int64, count=int(offsets[-1]))
    return offsets, flat


def _blob(seq: int, offsets: np.ndarray, flat: np.ndarray, seed: int | None) -> np.ndarray:
    # [seq, batches, offsets..., indices..., seed known, the seed's uint64 bits as an int64]
    tail = np.array([seed is not None, 0], dtype=np.int64)
    if seed is not None:
        tail[1:] = np.array([seed], dtype=np.uint64).view(np.int64)
    return np.concatenate([np.array([seq, len(offsets) - 1], dtype=np.int64), offsets, flat, tail])


def _unpack(blob: np.ndarray, at: int, nb: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(offsets, flat, end) of the ``nb`` batches packed at ``blob[at:]``; None if malformed."""
    offsets = blob[at : at + nb + 1]
    if nb < 0 or len(offsets) != nb + 1 or offsets[0] != 0:
        return None
    end = at + nb + 1 + int(offsets[-1])
    if end > len(blob) or np.any(np.diff(offsets) < 0):
        return None
    return offsets, blob[at + nb + 1 : end], end

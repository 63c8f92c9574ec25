"""Look-ahead: fetch the samples that come next in the sampler's order, before they are asked for.

An epoch's order is known as soon as the sampler is iterated. :class:`PlanningBatchSampler` wraps the
DataLoader's batch sampler, materialises each epoch's batches and publishes them as a *plan* in a small
shared directory (``/dev/shm`` when available). Each process that serves batches (a DataLoader worker,
or the main process with ``num_workers=0``) reads the plan, finds the batch it was just given, and
stages the batches it will be given next: the DataLoader hands batch ``k`` to worker ``k % W``, so
worker ``w`` stages batches ``k+W, k+2W, ...`` up to a depth in samples and in bytes (reached over
the epoch's first batches: two batches ahead, then doubling). Staged bytes live
in a bounded in-memory :class:`Stager` and are dropped once consumed. If the plan does not match (a
sampler blobdata did not see), nothing is staged and batches are still fetched all at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import threading
import uuid
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import numpy as np

from .. import _process
from .._node import shm
from .packed import PackedBatches, Predicted

log = logging.getLogger("blobdata")

__all__ = [
    "KeyedBatch", "LookAhead", "Plan", "PlanChannel", "PlanningBatchSampler", "Stager", "sweep_dead_channels",
]  # fmt: skip


class Plan:
    """One epoch's batches: ``flat`` indices, ``offsets``; batch k is ``flat[offsets[k]:offsets[k+1]]``.
    ``next``: the next epoch's batches where they are known before it begins (persistent workers)."""

    def __init__(self, seq: int, flat: np.ndarray, offsets: np.ndarray, next: Plan | None = None) -> None:
        self.seq = seq
        self.flat = flat
        self.offsets = offsets
        self.next = next
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

    def publish(self, batches: Sequence[Sequence[int]]) -> Plan:
        """Write one epoch's plan atomically; workers pick it up on their next batch."""
        offsets, flat = _pack(batches)
        self._seq += 1
        seq = self._seq
        self._write("plan.npy", _blob(seq, offsets, flat))
        plan = Plan(seq, flat, offsets)
        self._cached = plan
        return plan

    def publish_next(self, seq: int, batches: Sequence[Sequence[int]]) -> None:
        """Write the batches of the epoch after plan ``seq`` (where they are known before it begins);
        workers read them when their look-ahead reaches plan ``seq``'s end (:meth:`next_of`)."""
        offsets, flat = _pack(batches)
        self._write("next.npy", _blob(seq, offsets, flat))

    def next_of(self, plan: Plan) -> Plan | None:
        """The next epoch's batches announced for ``plan``, read once published; None until then."""
        if plan.next is None:
            got = self._read("next.npy")
            if got is not None and got.seq == plan.seq:
                plan.next = Plan(-plan.seq, got.flat, got.offsets)
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
        if blob.dtype != np.int64 or blob.ndim != 1 or len(blob) < 3:
            return None
        got = _unpack(blob, 2, int(blob[1]))
        if got is None or got[2] != len(blob):
            return None
        return Plan(int(blob[0]), got[1], got[0])

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


def _blob(seq: int, offsets: np.ndarray, flat: np.ndarray) -> np.ndarray:
    return np.concatenate([np.array([seq, len(offsets) - 1], dtype=np.int64), offsets, flat])


def _unpack(blob: np.ndarray, at: int, nb: int) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(offsets, flat, end) of the ``nb`` batches packed at ``blob[at:]``; None if malformed."""
    offsets = blob[at : at + nb + 1]
    if nb < 0 or len(offsets) != nb + 1 or offsets[0] != 0:
        return None
    end = at + nb + 1 + int(offsets[-1])
    if end > len(blob) or np.any(np.diff(offsets) < 0):
        return None
    return offsets, blob[at + nb + 1 : end], end


class KeyedBatch(list[int]):
    """A batch's indices, with the seed its samples' augmentation draws are keyed by (the loader's
    seed mixed with the epoch; see :mod:`blobdata._sampling.rng`). DataLoader hands the batch
    sampler's lists as they are to the dataset's ``__getitems__`` (pickled to a worker), so the seed
    travels with the very batch it belongs to, whichever worker serves it."""

    def __init__(self, indices: Sequence[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyedBatch, (list(self), self.seed))


class PlanningBatchSampler:
    """Wraps a batch sampler; each ``iter()`` publishes the epoch's batches before yielding them.

    The order is exactly the wrapped sampler's (``RandomSampler`` with a generator, a seeded sampler,
    ``DistributedSampler`` after ``set_epoch``): this only observes it.

    ``next_epoch`` (a :class:`blobdata._sampling.NextEpoch`) knows the samplers whose batches it can
    compute as arrays (``order``: the same draws, no Python list per batch) and predict for the next
    epoch (``prepare``). With ``across_epochs`` (persistent workers) the next epoch's batches are
    predicted in a thread during the epoch and published; when that epoch begins from the very sampler
    state they were predicted from, they are its batches and the sampler is not iterated again.
    """

    def __init__(
        self,
        batch_sampler: Any,
        channel: PlanChannel,
        progress: Any = None,
        next_epoch: Any = None,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.channel = channel
        self.progress = progress  # a resumed epoch drops its first batches before they are planned
        # Prepares the next epoch's batches from the batch sampler, where they can be known: with
        # `across_epochs` (persistent workers) they are computed in a thread and published during the
        # epoch, so that the look-ahead runs across its end, and the next epoch starts from them.
        self.next_epoch = next_epoch
        self.across_epochs = False
        self._predicted: Predicted | None = None
        self.epochs_predicted = 0  # epochs whose batches were the prediction (the sampler not iterated)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the wrapped sampler runs at the first next(), as it does inside a plain
        # DataLoader (which draws its worker base seed from the generator between iter() and
        # next()), so a seeded generator gives exactly the plain DataLoader's order.
        skip = self.progress.begin() if self.progress is not None else 0
        seed = self.progress.sample_seed() if self.progress is not None else None
        # The batches predicted for this epoch, if it begins from the state they were predicted from;
        # else the sampler iterated into arrays, where its kind is known (the same draws).
        batches: Sequence[list[int]] | PackedBatches
        predicted, self._predicted = self._predicted, None
        got = predicted.take(self.batch_sampler) if predicted is not None else None
        if got is not None:
            self.epochs_predicted += 1
        else:
            order = self.next_epoch.order(self.batch_sampler) if self.next_epoch is not None else None
            got = PackedBatches(*order) if order is not None else None
        if got is not None:
            batches = got[skip:] if skip else got
        else:  # a batch sampler of a kind not known here: its own batches, listed as they are
            listed = (list(b) if seed is None else KeyedBatch(b, seed) for b in self.batch_sampler)
            batches = list(itertools.islice(listed, skip, None))
        plan = self.channel.publish(batches)
        if self.progress is not None:
            self.progress.planned(batches)
        self._predict_next(plan.seq)
        if isinstance(batches, PackedBatches):
            flat, offsets = batches.flat, batches.offsets.tolist()
            for a, b in itertools.pairwise(offsets):
                indices: list[int] = flat[a:b].tolist()
                yield indices if seed is None else KeyedBatch(indices, seed)
        else:
            yield from batches

    def _predict_next(self, seq: int) -> None:
        make = self.next_epoch.prepare(self.batch_sampler) if self.across_epochs and self.next_epoch else None
        if make is None:
            return
        # Off the epoch's start, in a thread: kept to be the next epoch's batches if it begins from the
        # sampler state it was predicted from.
        predicted = Predicted(make)
        # Not a daemon: a program that ends meanwhile waits for it (a fraction of a second), where a
        # daemon thread still in torch would abort the interpreter's exit ("terminate called ...").
        threading.Thread(target=_announce, args=(self.channel, seq, predicted.compute)).start()
        self._predicted = predicted

    def __len__(self) -> int:
        # The whole epoch's count, also while an elastic sampler leaves out a resumed epoch's start.
        extra = self.progress.resumed_batches() if self.progress is not None else 0
        return len(self.batch_sampler) + extra

    def __getattr__(self, name: str) -> Any:
        # set_epoch, sampler, batch_size, drop_last ... of the wrapped batch sampler.
        if name in ("batch_sampler", "channel", "progress", "next_epoch", "across_epochs", "_predicted",
                    "epochs_predicted"):  # fmt: skip
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def _announce(channel: PlanChannel, seq: int, make: Callable[[], Sequence[Sequence[int]]]) -> None:
    try:
        channel.publish_next(seq, make())
    except Exception:  # a prediction is an optimisation: the epoch's own plan is the truth
        log.debug("blobdata: the next epoch's order could not be announced", exc_info=True)


def _consume(task: asyncio.Task[bytes]) -> None:
    # A dropped look-ahead fetch may have failed; its error matters only if the sample is asked for.
    if not task.cancelled():
        task.exception()


class Stager:
    """Bounded staging area of fetched-ahead bytes in one process, keyed by sample index.

    ``max_items`` and ``max_bytes`` bound what is staged or in flight (bytes counted by the listed
    object sizes). Runs on the process's blobdata event loop; ``take`` is called from the loop too.
    """

    def __init__(
        self,
        fetch: Callable[[int], Coroutine[Any, Any, bytes]],
        size_of: Callable[[int], int],
        *,
        max_items: int,
        max_bytes: int,
    ) -> None:
        self._fetch = fetch
        self._size_of = size_of
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._tasks: dict[int, asyncio.Task[bytes]] = {}
        self._bytes = 0
        self.peak_items = 0
        self.peak_bytes = 0

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._tasks)

    def schedule(self, indices: Sequence[int]) -> int:
        """Start fetching ``indices`` in order until a bound is reached; returns how many were started."""
        started = 0
        for raw in indices:
            i = int(raw)
            if i in self._tasks:
                continue
            size = self._size_of(i)
            if len(self._tasks) >= self.max_items or (self._tasks and self._bytes + size > self.max_bytes):
                break
            self._tasks[i] = asyncio.ensure_future(self._fetch(i))
            self._bytes += size
            started += 1
        self.peak_items = max(self.peak_items, len(self._tasks))
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        return started

    def pop(self, index: int) -> asyncio.Task[bytes] | None:
        """Remove and return the staged fetch of ``index`` (None if not staged)."""
        task = self._tasks.pop(index, None)
        if task is not None:
            self._bytes -= self._size_of(index)
        return task

    def clear(self) -> None:
        """Drop everything staged or in flight (a new epoch made it useless)."""
        tasks, self._tasks, self._bytes = self._tasks, {}, 0
        for task in tasks.values():
            task.cancel()
            task.add_done_callback(_consume)


class LookAhead:
    """One process's look-ahead: its :class:`Stager` and where the current epoch's ramp stands.

    After each batch it is given, the process calls :meth:`advance` with the batch's indices; the
    look-ahead finds that batch in the loader's plan and stages this process's next batches (every
    ``stride``-th batch: the DataLoader deals batches round-robin to its workers). Each epoch starts
    two batches ahead and doubles per batch up to ``max_items`` samples, so that the first batch does
    not wait behind a burst of requests.

    Where the plan carries the next epoch's batches (persistent workers), staging goes on past the
    epoch's end into this process's first two batches of the next epoch (a persistent DataLoader
    deals each epoch from worker 0 again), within the same bounds; when that epoch's plan arrives and
    is the one announced, what was staged is kept and the ramp goes on from there: the next epoch's
    first batches do not wait for their fetches.
    """

    def __init__(
        self,
        fetch: Callable[[int], Coroutine[Any, Any, bytes]],
        size_of: Callable[[int], int],
        *,
        max_items: int,
        max_bytes: int,
    ) -> None:
        self.stager = Stager(fetch, size_of, max_items=max_items, max_bytes=max_bytes)
        self._plan_key: tuple[str, int] | None = None  # (channel, plan) of the epoch being staged
        self._plan: Plan | None = None
        self._ramp = 0  # batches served this epoch, up to where the depth is full

    def take(self, index: int) -> asyncio.Task[bytes] | None:
        """The staged fetch of ``index`` (removed from the staging area), or None."""
        return self.stager.pop(index)

    def advance(self, channel: PlanChannel, indices: Sequence[int], stride: int) -> None:
        """Stage what this process will be given after the batch ``indices`` (call on the loop)."""
        plan = channel.current()
        k = plan.locate(indices) if plan is not None else None
        if plan is None or k is None:
            plan = channel.current(reload=True)
            k = plan.locate(indices) if plan is not None else None
            if plan is None or k is None:
                return  # a sampler blobdata did not see: batches are still fetched all at once
        stager = self.stager
        if self._plan_key != (channel.path, plan.seq):
            # A new epoch, or a new loader (whose channel numbers its plans from 1 again): what was
            # staged for the old order is useless, unless it was staged for this very order.
            prev = self._plan
            announced = prev is not None and prev.next is not None and prev.next.same_batches(plan)
            if not (announced and self._plan_key is not None and self._plan_key[0] == channel.path):
                stager.clear()
                self._ramp = 0
            else:  # its first two batches are staged: the ramp goes on from there
                self._ramp = min(self._ramp, 1)
            self._plan_key = (channel.path, plan.seq)
            self._plan = plan
        depth = min(stager.max_items, max(len(indices), 1) << (self._ramp + 1))
        if depth < stager.max_items:
            self._ramp += 1
        ahead: list[int] = []
        nxt = k + stride
        while nxt < plan.num_batches and len(ahead) < depth:
            ahead.extend(plan.batch(nxt).tolist())
            nxt += stride
        upcoming = channel.next_of(plan) if nxt >= plan.num_batches and len(ahead) < depth else None
        if upcoming is not None:  # across the epoch's end: this process's first two batches of the next
            # (the ramp's start: a whole epoch staged at once would make its first batch wait for all)
            nxt, limit = k % stride, min(depth, len(ahead) + 2 * max(len(indices), 1))
            while nxt < upcoming.num_batches and len(ahead) < limit:
                ahead.extend(upcoming.batch(nxt).tolist())
                nxt += stride
        stager.schedule(ahead)

    def clear(self) -> None:
        """Drop everything staged (call on the loop)."""
        self.stager.clear()

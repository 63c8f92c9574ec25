"""Live statistics of the input pipeline, summed over a loader's processes: is data loading the bottleneck?

Each process that serves samples (a DataLoader worker, or the training process with ``num_workers=0``)
counts into one fixed-size record of float64 slots: samples served and where their bytes came from,
bytes, GETs with a log-bucket latency histogram, retries by cause, and the seconds spent waiting for
bytes, reading the cache, decoding, transforming and collating. Once the process works for a loader
(:func:`attach`), its record is a file in the loader's plan-channel directory (``/dev/shm``, mode 0700)
mapped into memory, so an update is a plain store into shared memory: no publishing step, no lag, and
nothing lost when a worker exits. The training process sums every record of the directory on
``loader.stats()``: fork, spawn and forkserver workers, persistent or not, and ``num_workers=0`` alike.
A record is raw native float64 with a magic number and its size first; a file that does not match is
ignored (nothing read back is ever unpickled).

The sums become a :class:`~blobdata.LoaderStats` in :mod:`.report`. Updates cost a few hundred
nanoseconds per sample (``benchmarks/bench_stats.py`` measures them against
the per-sample work). Each slot has one writer thread per process: the loop thread counts fetches and
cache reads, the worker's thread counts decode, transform and collate.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import numpy as np

from .. import _process

__all__ = [
    "Slots", "TimedCollate", "Records", "attach", "combined", "count_for", "counting_for", "for_next_epoch",
    "count_in", "next_epoch", "note_inflight", "note_peer", "note_rate_limit", "note_throttled", "rec",
    "shared_record",
]  # fmt: skip

log = logging.getLogger("blobdata")

# -- the record's layout ---------------------------------------------------------------------------
_MAGIC = 6.02214e23 + 14.0  # slot 0: marks a blobdata stats record
(
    SERVED, FROM_CACHE, FROM_BUCKET, STAGED, ERRORS, BATCHES, BYTES_BUCKET, BYTES_CACHE, GETS, GET_S,
    R_THROTTLE, R_SERVER, R_TIMEOUT, R_CONNECTION, R_SHORT_READ, R_OTHER,
    FETCH_WAIT_S, CACHE_S, DECODE_S, TRANSFORM_S, COLLATE_S, CACHE_STORED, CACHE_DROPPED,
    DEVICE_DECODED, DEVICE_REFUSED, WORKER_DECODED, THROTTLED, INFLIGHT, INFLIGHT_S, RATE_LIMIT,
    BUILT_AHEAD,
) = range(2, 33)  # fmt: skip
#: Gauges (a value now, not a count): a record of an exited process adds 0; the rate limit is a maximum.
_GAUGES = (INFLIGHT, RATE_LIMIT)
_RETRY_SLOT = {
    "throttle": R_THROTTLE, "server": R_SERVER, "timeout": R_TIMEOUT, "connection": R_CONNECTION,
    "short_read": R_SHORT_READ,
}  # fmt: skip
_HIST0 = 33
#: GET latency histogram: 4 buckets per octave from 10 us; the last bucket holds everything above ~170 s.
_BUCKETS = 96
_BASE_S = 1e-5
#: What the thread that serves batches counts itself, once per batch (reads made without the loop: cache
#: hits looked up per batch, local files): slots of their own, so that each slot keeps one writer thread,
#: folded into the loop thread's counterparts when records are summed (:data:`_FOLDED`).
(B_FROM_CACHE, B_BYTES_CACHE, B_CACHE_S, B_FROM_BUCKET, B_BYTES_BUCKET, B_CACHE_DROPPED) = range(
    _HIST0 + _BUCKETS, _HIST0 + _BUCKETS + 6
)
#: Objects read for the next epoch before it began (its first batches: staged across the epoch's end,
#: built ahead, handed over to new workers), from the cache and from the bucket: counted apart, so that
#: an epoch's hit rate and reads are its own (:func:`for_next_epoch`).
(N_FROM_CACHE, N_FROM_BUCKET) = range(_HIST0 + _BUCKETS + 6, _HIST0 + _BUCKETS + 8)
#: Peers (:mod:`blobdata._peers`), on the loop thread. Asking: objects read from another node's cache
#: (for this epoch, for the next), their bytes and seconds, reads that went to the bucket instead (the
#: peer down, busy, refusing or wrong), bucket reads started because a peer was slow (hedged), answers
#: refused as wrong. Serving (this process runs its node's service): answers given, their bytes, objects
#: read from the bucket for them, requests refused.
(
    FROM_PEER, N_FROM_PEER, BYTES_PEER, PEER_S, PEER_FALLBACK, PEER_HEDGED, PEER_WRONG,
    PEER_SERVED, PEER_SERVED_BYTES, PEER_SERVED_FETCHED, PEER_REFUSED,
) = range(_HIST0 + _BUCKETS + 8, _HIST0 + _BUCKETS + 19)  # fmt: skip
#: Peer answer latency histogram: 2 buckets per octave from 100 us (the last: above ~6.5 s).
_PHIST0, _PBUCKETS, _PBASE_S = _HIST0 + _BUCKETS + 19, 32, 1e-4
#: Samples the thread serving batches took from what was fetched for it ahead (a new worker's
#: hand-over), counted with those the loop took from its look-ahead.
B_STAGED = _PHIST0 + _PBUCKETS
_FOLDED = (
    (B_FROM_CACHE, FROM_CACHE), (B_BYTES_CACHE, BYTES_CACHE), (B_CACHE_S, CACHE_S),
    (B_FROM_BUCKET, FROM_BUCKET), (B_BYTES_BUCKET, BYTES_BUCKET), (B_CACHE_DROPPED, CACHE_DROPPED),
    (B_STAGED, STAGED),
)  # fmt: skip
SIZE = B_STAGED + 1  # slots (8 bytes each); slot 1 holds SIZE, a layout check

#: Slots a source's record keeps for itself alone: the loader's whole count has them from the main record.
_OWN_SLOTS = (SERVED, FETCH_WAIT_S)

#: Set while reads for the next epoch are started (tasks made in this context inherit it).
_next_epoch: contextvars.ContextVar[bool] = contextvars.ContextVar("blobdata_next_epoch", default=False)


@contextlib.contextmanager
def for_next_epoch() -> Iterator[None]:
    """Reads started inside are the next epoch's (counted in ``read_for_next_epoch``, not this epoch's)."""
    token = _next_epoch.set(True)
    try:
        yield
    finally:
        _next_epoch.reset(token)


def next_epoch() -> bool:
    """Whether the read running now is for the next epoch (:func:`for_next_epoch`)."""
    return _next_epoch.get()


#: The source of a mixture whose work is being counted (-1: none; the process's main record). A
#: mixture's sources count into records of their own (:func:`counting_for`), summed apart by
#: :meth:`Records.by_source` and together by :meth:`Records.total`.
_source: contextvars.ContextVar[int] = contextvars.ContextVar("blobdata_stats_source", default=-1)


@contextlib.contextmanager
def counting_for(source: int) -> Iterator[None]:
    """Counts made inside (this thread, and tasks started inside) go to source ``source``'s record."""
    token = _source.set(source)
    try:
        yield
    finally:
        _source.reset(token)


def count_for(source: int) -> None:
    """The rest of the running task counts for source ``source`` (call inside a task of its own)."""
    _source.set(source)


class Slots(Protocol):
    """A record's float64 slots (a ``memoryview`` cast to ``"d"``)."""

    def __getitem__(self, i: int, /) -> float: ...
    def __setitem__(self, i: int, value: float, /) -> None: ...


def _fresh() -> Slots:
    v = cast(Slots, memoryview(bytearray(SIZE * 8)).cast("d"))
    v[0], v[1] = _MAGIC, float(SIZE)
    return v


class _Record:
    """This process's record: private until :func:`attach` maps it into a loader's directory."""

    def __init__(self) -> None:
        self.v = _fresh()
        self.directory: str | None = None  # the view keeps its mapping alive; unmapped once unused


_rec = _Record()
_sources: dict[int, _Record] = {}  # a mixture's sources' records in this process, by source number


#: This process's requests in flight, and when that number last changed (``time.monotonic()``).
_inflight = [0.0, 0.0]


#: Records that processes working for this one count into (its node's peer service, in a process of
#: its own): a loader made here adds what they counted while it lived (:class:`Records`).
_shared: list[Slots] = []


def _forget_in_child() -> None:
    # A forked child starts from zero and never writes into its parent's record.
    global _rec
    _process.orphan(_rec)
    _process.orphan(list(_sources.values()))
    _process.orphan(list(_shared))
    _rec = _Record()
    _sources.clear()
    _shared.clear()
    _inflight[:] = [0.0, 0.0]


_process.at_fork(after_in_child=_forget_in_child)


def rec() -> Slots:
    """This process's counters (index with the slot constants; ``v[SERVED] += n``): those of the
    mixture's source being counted (:func:`counting_for`), if any."""
    k = _source.get()
    return _rec.v if k < 0 else _source_record(k)


def _source_record(k: int) -> Slots:
    r = _sources.get(k)
    if r is None or r.directory != _rec.directory:
        r = _Record()
        if _rec.directory is not None:
            mapped = _mapped(_rec.directory, f"-{k}")
            if mapped is not None:
                r.v, r.directory = mapped, _rec.directory
        _sources[k] = r
    return r.v


def _mapped(directory: str, suffix: str = "") -> Slots | None:
    """A new record file in ``directory``, mapped; None where it cannot be made."""
    path = os.path.join(directory, f"stats-{_process.pid()}-{uuid.uuid4().hex[:8]}{suffix}.bin")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SIZE * 8)
            mm = mmap.mmap(fd, SIZE * 8)
        finally:
            os.close(fd)
    except OSError as exc:  # a directory gone or full: keep counting privately
        log.debug("blobdata: stats record in %s unavailable: %s", directory, exc)
        return None
    v = cast(Slots, memoryview(mm).cast("d"))
    v[0], v[1] = _MAGIC, float(SIZE)
    return v


def attach(directory: str) -> None:
    """Count this process's work from now on in a new record file in ``directory`` (a loader's plan
    channel). Counts made before stay where they were: a loader's stats are its own processes' work."""
    r = _rec
    if r.directory == directory:
        return
    v = _mapped(directory)
    if v is None:
        return
    v[INFLIGHT], v[RATE_LIMIT] = _inflight[0], r.v[RATE_LIMIT]
    r.v, r.directory = v, directory


def shared_record() -> tuple[int, Slots | None]:
    """A new record in anonymous shared memory, for a process this one starts to count into
    (:func:`count_in`, the descriptor passed to it): its descriptor (the caller closes it once passed)
    and its mapping here, which the loaders made from now on add to their sums. ``(-1, None)`` where no
    such memory can be made (not Linux): that process's counts are then its own."""
    try:
        fd = os.memfd_create("blobdata-stats", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return -1, None
    try:
        os.ftruncate(fd, SIZE * 8)
        mm = mmap.mmap(fd, SIZE * 8)
    except OSError:
        os.close(fd)
        return -1, None
    v = cast(Slots, memoryview(mm).cast("d"))
    v[0], v[1] = _MAGIC, float(SIZE)
    _shared.append(v)
    return fd, v


def count_in(fd: int) -> None:
    """Count this process's work into the record of descriptor ``fd`` (:func:`shared_record`, made by
    the process that started this one), checked to be one; else counts stay private."""
    try:
        mm = mmap.mmap(fd, SIZE * 8)
    except (OSError, ValueError):
        return
    finally:
        os.close(fd)
    v = cast(Slots, memoryview(mm).cast("d"))
    if v[0] == _MAGIC and v[1] == SIZE:
        _rec.v = v


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


class Records:
    """The records in one loader's directory, summed on demand (in the process that made the loader).

    A record of a process that has exited is folded into a running sum and its file removed, so that
    non-persistent workers (new processes each epoch) do not pile up files over a long run.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._retired: dict[int, np.ndarray] = {}  # by source (-1: the main records)
        #: What the shared records (:func:`shared_record`) held when this loader was made, by id: the
        #: loader counts their work from then on.
        self._shared_from = {id(v): np.array(v, dtype=np.float64) for v in _shared}

    def total(self) -> np.ndarray:
        """The sum of every valid record, those of exited processes included (a mixture's sources'
        too, but for the slots the main records count: :data:`_OWN_SLOTS`)."""
        return combined(*self.by_source())

    def by_source(self) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """The main records' sum, and each mixture source's (by source number)."""
        sums: dict[int, np.ndarray] = {k: v.copy() for k, v in self._retired.items()}
        try:
            names = os.listdir(self.directory)
        except OSError:
            names = []
        for name in names:
            parts = name[:-4].split("-")  # stats-<pid>-<id>.bin, a source's stats-<pid>-<id>-<k>.bin
            if not (name.endswith(".bin") and len(parts) in (3, 4) and parts[0] == "stats"):
                continue
            if not parts[1].isdigit() or (len(parts) == 4 and not parts[3].isdigit()):
                continue
            k = int(parts[3]) if len(parts) == 4 else -1
            total = sums.setdefault(k, np.zeros(SIZE, dtype=np.float64))
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as fh:
                    data = fh.read(SIZE * 8 + 1)
            except OSError:
                continue
            if len(data) != SIZE * 8:
                continue
            arr = np.frombuffer(data, dtype=np.float64)
            if arr[0] != _MAGIC or arr[1] != SIZE:
                continue
            pid = int(parts[1])
            dead = pid != _process.pid() and not _alive(pid)
            if dead:
                arr = arr.copy()
                arr[list(_GAUGES)] = 0.0  # nothing in flight, no limit seen: it is gone
            _add(total, arr)
            if dead:  # it writes no more: fold it in
                try:
                    os.unlink(path)
                except OSError:
                    continue
                _add(self._retired.setdefault(k, np.zeros(SIZE, dtype=np.float64)), arr)
        main = sums.pop(-1, None)
        if main is None:
            main = np.zeros(SIZE, dtype=np.float64)
        for v in _shared:  # counted for this process by the ones it started, since this loader was made
            now = np.array(v, dtype=np.float64)
            was = self._shared_from.setdefault(id(v), np.zeros(SIZE, dtype=np.float64))
            since = now - was
            since[list(_GAUGES)] = now[list(_GAUGES)]
            _add(main, since)
        return main, sums


def combined(main: np.ndarray, sources: dict[int, np.ndarray]) -> np.ndarray:
    """The whole loader's sum from :meth:`Records.by_source`'s parts (a source's own slots left out)."""
    total: np.ndarray = main.copy()
    for arr in sources.values():
        part = arr.copy()
        part[list(_OWN_SLOTS)] = 0.0
        _add(total, part)
    return total


def _add(total: np.ndarray, arr: np.ndarray) -> None:
    """``arr``'s counts into ``total`` (the rate limit a maximum)."""
    rate_limit = max(total[RATE_LIMIT], arr[RATE_LIMIT])
    total[2:] += arr[2:]
    total[RATE_LIMIT] = rate_limit


# -- hooks called on the data path -------------------------------------------------------------------
def note_get(seconds: float, nbytes: int) -> None:
    """One GET answered in ``seconds`` with ``nbytes`` of body (called on the loop thread)."""
    v = rec()
    v[GETS] += 1
    v[GET_S] += seconds
    v[BYTES_BUCKET] += nbytes
    b = int(math.log2(seconds / _BASE_S) * 4) if seconds > _BASE_S else 0
    v[_HIST0 + min(b, _BUCKETS - 1)] += 1


def note_peer(seconds: float, nbytes: int, reads: int = 1) -> None:
    """A peer answered ``reads`` reads (one request) in ``seconds`` with ``nbytes`` accepted in all;
    each read counts as answered in ``seconds`` (called on the loop thread)."""
    v = rec()
    v[PEER_S] += seconds * reads
    v[BYTES_PEER] += nbytes
    b = int(math.log2(seconds / _PBASE_S) * 2) if seconds > _PBASE_S else 0
    v[_PHIST0 + min(b, _PBUCKETS - 1)] += reads


def note_retry(kind: str) -> None:
    """A transient failure of ``kind`` that will be retried (called on the loop thread)."""
    rec()[_RETRY_SLOT.get(kind, R_OTHER)] += 1


def note_throttled() -> None:
    """The store answered a request with throttling (429, 503 SlowDown / ServerBusy)."""
    rec()[THROTTLED] += 1


def note_inflight(delta: int, now: float) -> None:
    """``delta`` requests started (+) or ended (-) at ``now`` (``time.monotonic()``; loop thread)."""
    v, state = _rec.v, _inflight
    if state[0]:
        v[INFLIGHT_S] += state[0] * (now - state[1])
    state[0] += delta
    state[1] = now
    v[INFLIGHT] = state[0]


def note_rate_limit(rate: float) -> None:
    """The request rate (per second) the node's throttle controller allows now; 0: no limit."""
    rec()[RATE_LIMIT] = rate


class TimedCollate:
    """Wraps the loader's ``collate_fn`` to count its seconds (in the worker that collates)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn: Callable[[Any], Any] = fn.fn if isinstance(fn, TimedCollate) else fn

    def __call__(self, batch: Any) -> Any:
        t = time.perf_counter()
        out = self.fn(batch)
        _rec.v[COLLATE_S] += time.perf_counter() - t
        return out


# -- the snapshot ------------------------------------------------------------------------------------

"""A batch's bytes by the shortest way: local files and cache hits read in the thread that serves the
batch (one index query per batch, no event loop, no task per sample), and only the rest fetched on the
process's loop, or taken from what the look-ahead fetched there. The look-ahead fetches only what the
node cache does not hold (it looks upcoming samples up there, one query per batch): what the cache holds
is read here, when its batch comes, by the thread that uses the bytes.

The thread serving batches counts what it read itself, once per batch, in slots of its own
(:data:`blobdata._metrics.stats.B_FROM_CACHE` ...): each counter keeps one writer thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import threading
import time
import weakref
from typing import Any, NamedTuple, Protocol

import numpy as np

from .. import _process
from .._cache import BlobCache, CacheWriter
from .._config import FetchOptions
from .._errors import BlobdataError
from .._fetch import IN_FLIGHT, FetchEngine, LookAhead
from .._loop import submit
from .._metrics import stats as _stats
from .._peers import PeerClient, PeerTable
from .._stores import read_local_file, resolve_storage_options
from .ahead import BuiltAhead

__all__ = [
    "PENDING", "Dataset", "Objects", "ProcessState", "read_batch", "read_direct", "take_handed",
    "take_staged",
]  # fmt: skip


class Dataset(Protocol):
    """What the reads need of a dataset (:class:`~blobdata._dataset.base.BlobDatasetBase`)."""

    _url: str
    _local_root: str | None
    _protocol: str
    _storage_options: dict[str, Any]
    cache: BlobCache | None
    fetch_options: FetchOptions
    _peers: PeerTable | None

    def __len__(self) -> int: ...

    def _objects(self, indices: list[int]) -> Objects: ...

    def _object_error(self, row: int, exc: BlobdataError) -> BlobdataError: ...


#: How long a batch waits for the look-ahead to move past the batch before it (it reads the cache for
#: what comes next): a loop that is this late is stuck, and the batch reads what it needs itself.
_ADVANCE_WAIT_S = 10.0

#: A sample the loop must fetch (staged there, or neither local nor in the cache).
PENDING: Any = object()


class Objects(NamedTuple):
    """The objects a batch of samples reads, in order: sample ``k`` reads ``offsets[k]:offsets[k+1]``
    (one object each when ``offsets`` is None); ``sizes`` -1 and ``ids`` "" where the listing did not
    say; ``rows`` the dataset's own numbering of them (its error messages use it)."""

    rows: list[int]
    offsets: list[int] | None
    urls: list[str]
    sizes: list[int]
    ids: list[str]


class ProcessState:
    """Per-process handles: fetch engine, cache, staging area. Never pickled."""

    def __init__(self, ds: Dataset) -> None:
        self.pid = _process.pid()
        self._engine: FetchEngine | None = None  # made at the first fetch (a mixture's own state: never)
        self._make_engine = functools.partial(
            _engine_for, ds.fetch_options, ds._protocol, ds._storage_options, ds._url
        )
        # The dataset's BlobCache (checked usable at construction) reopens its index in each process.
        self.cache: BlobCache | None = ds.cache
        self.writer = CacheWriter(self.cache, on_stored=_count_stored) if self.cache is not None else None
        # Peers on: what this node is not home for is asked of its home node first.
        table = getattr(ds, "_peers", None)
        self.peers = PeerClient(table) if table is not None else None
        #: Homes of objects the look-ahead found missing and is fetching, scored as one batch when it
        #: looked them up (:func:`~blobdata._dataset.peering.note_homes`); each read takes its own.
        self.homes: dict[str, int] = {}
        #: The same by sample, where the look-ahead starts its misses' reads from the notes
        #: (``starts_noted``: a FolderDataset's, one object a sample): the object's URL, size, identity
        #: and home (not looked up in the listing again).
        self.noted: dict[int, tuple[str, int, str, int]] = {}
        self.starts_noted = False
        self.lookahead: LookAhead | None = None
        self.built: BuiltAhead | None = None  # the next epoch's first batch, built while idle
        self.handing: concurrent.futures.Future[None] | None = None  # fetches for the next workers
        #: A new worker's hand-over (what the training process fetched for its first batches), taken
        #: by the thread serving them (:func:`take_handed`); the look-ahead does not stage it.
        self.handed: dict[int, Any] = {}
        self.advancing: threading.Event | None = None  # set once the look-ahead moved past the last batch
        #: The last batch read here and its objects' URLs, which making its samples needs again.
        self.urls: tuple[list[int], list[str]] | None = None
        #: The samples this process read from the cache, under "admit" (where entries stay until trimmed
        #: or cleared): the look-ahead does not look them up again.
        self.held = Held(len(ds)) if self.cache is not None and self.cache.policy == "admit" else None
        if self.peers is not None:  # its connections to the peers, closed as the engine's are
            weakref.finalize(self, _close_peers, self.peers, self.pid)

    @property
    def engine(self) -> FetchEngine:
        """This process's fetch engine for the dataset's store (made at first use)."""
        engine = self._engine
        if engine is None:
            engine = self._engine = self._make_engine()
            # Connections belong to this process's loop: close them there when this state goes away
            # (the engine closes them itself at interpreter exit).
            weakref.finalize(self, _close_engine, engine, self.pid)
        return engine

    def close_engine(self) -> None:
        """Close the fetch engine, if one was made."""
        if self._engine is not None:
            self._engine.close()


def _engine_for(
    options: FetchOptions, protocol: str, storage_options: dict[str, Any], url: str
) -> FetchEngine:
    return FetchEngine(options, protocol, resolve_storage_options(protocol, storage_options), root=url)


class Held:
    """Which samples one process found in the node cache, a bit each (1 M samples: 128 KiB). Written by
    the thread serving batches only (a hit marks, a miss clears); read by the look-ahead on the loop. A
    stale mark (an entry trimmed away since) costs that sample a fetch when its batch comes, not a wrong
    byte: the batch reads the cache itself."""

    def __init__(self, n: int) -> None:
        self._bits = np.zeros((n + 7) // 8, dtype=np.uint8)

    def unknown(self, indices: list[int]) -> list[int]:
        """Those of ``indices`` not known to be held (all of them where the marks say nothing)."""
        at = np.asarray(indices, dtype=np.int64)
        known = (self._bits[at >> 3] >> (at & 7).astype(np.uint8)) & 1
        if known.all():
            return []
        out: list[int] = at[known == 0].tolist()
        return out

    def mark(self, indices: list[int], held: list[bool]) -> None:
        """``indices`` were found held (True) or missing (False) in the cache just now."""
        at = np.asarray(indices, dtype=np.int64)
        yes = np.asarray(held, dtype=bool)
        bits = (1 << (at & 7)).astype(np.uint8)
        np.bitwise_or.at(self._bits, at[yes] >> 3, bits[yes])
        np.bitwise_and.at(self._bits, at[~yes] >> 3, ~bits[~yes])


def _count_stored(n: int) -> None:
    _stats.rec()[_stats.CACHE_STORED] += n


def _close_engine(engine: FetchEngine, pid: int) -> None:
    if _process.pid() == pid:
        with contextlib.suppress(RuntimeError):  # interpreter shutting down: the loop is gone
            submit(engine.aclose())


def _close_peers(peers: PeerClient, pid: int) -> None:
    if _process.pid() == pid:
        with contextlib.suppress(RuntimeError):
            submit(peers.aclose())


def read_batch(ds: Dataset, proc: ProcessState, idx: list[int]) -> list[Any]:
    """Each sample's data (or the error met reading it) where it could be had without the loop; else
    :data:`PENDING`."""
    out = take_staged(proc, idx)
    if proc.handed:
        take_handed(proc, idx, out)
    read_direct(ds, proc, idx, out)
    return [PENDING if d is IN_FLIGHT else d for d in out]


def take_handed(proc: ProcessState, idx: list[int], out: list[Any]) -> None:
    """Fill ``out[k]`` still :data:`PENDING` with what was handed over to this worker for sample
    ``idx[k]`` (taken once: a sample read again later in the epoch is read as any other)."""
    handed = proc.handed
    n = 0
    for k, i in enumerate(idx):
        if out[k] is PENDING:
            data = handed.pop(i, PENDING)
            if data is not PENDING:
                out[k] = data
                n += 1
    _stats.rec()[_stats.B_STAGED] += n


def take_staged(proc: ProcessState, idx: list[int]) -> list[Any]:
    """For each sample of the batch ``idx``: :data:`IN_FLIGHT` where the look-ahead of ``proc`` fetches
    it (taken on the loop), else :data:`PENDING` (no longer marked present: the caller reads it)."""
    out: list[Any] = [PENDING] * len(idx)
    advancing, proc.advancing = proc.advancing, None
    if advancing is not None:  # what it stages (its first move makes it) is taken from it, not read here
        advancing.wait(_ADVANCE_WAIT_S)
    staging = proc.lookahead
    if staging is not None:
        for k, fetching in enumerate(staging.stager.take_ready(idx)):
            if fetching:
                out[k] = IN_FLIGHT
    return out


def read_direct(ds: Dataset, proc: ProcessState, idx: list[int], out: list[Any]) -> None:
    """Fill ``out[k]`` still :data:`PENDING` with what needs no loop: cache hits and local files of
    ``ds`` (whose per-process state is ``proc``)."""
    local = ds._local_root is not None
    if proc.cache is None and not local:
        return
    rest = [k for k in range(len(idx)) if out[k] is PENDING]
    if rest:
        _read_direct(ds, proc, idx, rest, out, local)


def _read_direct(
    ds: Dataset, proc: ProcessState, idx: list[int], rest: list[int], out: list[Any], local: bool
) -> None:
    """Fill ``out[k]`` for ``k`` in ``rest`` from the cache (one lookup) and, for a local folder, by
    reading the files."""
    obj = ds._objects(idx if len(rest) == len(idx) else [idx[k] for k in rest])
    proc.urls = (idx, obj.urls) if len(rest) == len(idx) else None
    m = len(obj.urls)
    bodies: list[Any] = [None] * m
    v = _stats.rec()
    cache = proc.cache
    if cache is not None:
        known = [j for j in range(m) if obj.ids[j]]
        if known:
            t = time.perf_counter()
            got = cache.get_many([(obj.urls[j], obj.ids[j]) for j in known])
            v[_stats.B_CACHE_S] += time.perf_counter() - t
            hits = nbytes = 0
            for j, data in zip(known, got, strict=True):
                if data is not None:
                    bodies[j] = data
                    hits += 1
                    nbytes += len(data)
            v[_stats.B_FROM_CACHE] += hits
            v[_stats.B_BYTES_CACHE] += nbytes
        held = proc.held
        if held is not None:  # for the look-ahead: these need no lookup next time (or do again)
            cached = [b is not None for b in bodies]
            if obj.offsets is not None:
                cached = [all(cached[a:b]) for a, b in itertools.pairwise(obj.offsets)]
            held.mark([idx[k] for k in rest], cached)
    if local:
        _read_files(ds, proc, obj, bodies)
    offsets = obj.offsets
    for pos, k in enumerate(rest):
        if offsets is None:
            data = bodies[pos]
            if data is not None:
                out[k] = data
            continue
        members = bodies[offsets[pos] : offsets[pos + 1]]
        if any(b is None for b in members):
            continue
        failed = next((b for b in members if isinstance(b, BaseException)), None)
        out[k] = failed if failed is not None else members


def _read_files(ds: Dataset, proc: ProcessState, obj: Objects, bodies: list[Any]) -> None:
    """Read what the cache did not have of a local folder's objects, in this thread (checked as
    :func:`blobdata._stores.read_local_file` says); offered to the cache where there is one."""
    writer = proc.writer
    reads = nbytes = dropped = 0
    for j, url in enumerate(obj.urls):
        if bodies[j] is not None:
            continue
        ident = obj.ids[j]
        if writer is not None and not ident:
            continue  # its identity is learned on the loop's path, where it is cached under it
        path = _path_of(url)
        size = obj.sizes[j]
        try:
            data = read_local_file(path, size if size >= 0 else None, ident or None, url)
        except BlobdataError as exc:
            bodies[j] = ds._object_error(obj.rows[j], exc)
            continue
        bodies[j] = data
        reads += 1
        nbytes += len(data)
        if writer is not None and not writer.offer(url, ident, data):
            dropped += 1
    v = _stats.rec()
    v[_stats.B_FROM_BUCKET] += reads
    v[_stats.B_BYTES_BUCKET] += nbytes
    if dropped:
        v[_stats.B_CACHE_DROPPED] += dropped


def _path_of(url: str) -> str:
    """The local path of a ``file://`` URL, as the fetch engine maps it."""
    rest = url[7:] if url.startswith("file://") else url
    return rest if rest.startswith("/") else "/" + rest


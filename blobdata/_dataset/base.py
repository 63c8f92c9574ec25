"""What every blobdata dataset shares: the per-process fetch engine and cache handle, the read path of
one object (cache, else bucket, then offered to the cache), the look-ahead along the loader's order,
``on_error``, pickling for workers, and :meth:`BlobDatasetBase.dataloader`.

A dataset built on it (:class:`~blobdata.FolderDataset`, :class:`~blobdata.BlobDataset`) says what one
sample index reads (:meth:`~BlobDatasetBase._load`: one object, or every member of a sample, fetched
together as one look-ahead unit), how many bytes that is (:meth:`~BlobDatasetBase._size_of`), and how
the fetched bytes become a sample (``__getitems__``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch.utils.data

from .. import _process
from .._cache import BlobCache
from .._config import FetchOptions
from .._errors import BlobdataError, ConfigError, note_fields
from .._fetch import LookAhead, PlanChannel
from .._loop import get_loop, run, submit
from .._metrics import SkipLog
from .._metrics import stats as _stats
from .._peers import PEERS_LOOKAHEAD, Peers, PeerTable
from .._stores import network_mount, redact
from .._url import parse_url, printable
from . import handover
from .ahead import BuiltAhead, Stopped
from .loader import BlobLoader
from .peering import join_peers, not_kept, note_homes, read_from_home
from .reads import PENDING, Objects, ProcessState, read_batch
from .settings import LEGACY_KEYWORDS, legacy_keywords, named_sampler, resolve_cache

__all__ = ["LEGACY_KEYWORDS", "BlobDatasetBase", "OnError", "legacy_keywords", "resolve_cache"]

log = logging.getLogger("blobdata")

OnError = Literal["raise", "skip"] | Callable[[str, BaseException], None]


class BlobDatasetBase:
    """The machinery of a dataset read from a store (see the module docstring); not used directly."""

    _url: str
    _local_root: str | None
    _protocol: str
    _storage_options: dict[str, Any]
    _raw = False

    def _setup(
        self,
        root: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None,
        cache: BlobCache | None,
        on_error: OnError,
        fetch_options: FetchOptions | None,
        lookahead: int | None = None,
        lookahead_bytes: int | str | None = None,
        peers: bool | Peers | None = None,
    ) -> str | os.PathLike[str]:
        """Set the settings every dataset has; returns the root as given (``~`` expanded). ``lookahead``
        and ``lookahead_bytes``, when given, are the former spellings of FetchOptions' own. ``peers``:
        meet the job's other nodes (:mod:`blobdata._peers`; a collective call, as the listing is)."""
        given = os.path.expanduser(root) if isinstance(root, str) else root
        url = parse_url(given)
        self._url = str(url)
        local = os.fspath(given) if url.protocol == "file" else None
        self._local_root = url.prefix if local is not None and local.startswith("file://") else local
        self.cache = cache
        if on_error not in ("raise", "skip") and not callable(on_error):
            raise ConfigError(f"on_error must be 'raise', 'skip' or a callable, got {on_error!r}")
        options = fetch_options if fetch_options is not None else FetchOptions()
        if lookahead is not None:
            options = options.replace(lookahead=lookahead)
        if lookahead_bytes is not None:
            options = options.replace(lookahead_bytes=lookahead_bytes)
        self._protocol = url.protocol
        self._storage_options = dict(storage_options or {})
        self.fetch_options = options
        self.on_error = on_error
        # A local disk: each batch reads its files directly, with no look-ahead unless asked for (a
        # network or FUSE mount keeps it: its reads have a network's latency).
        on_disk = self._local_root is not None and not network_mount(self._local_root)
        self.lookahead = 0 if on_disk and not options.lookahead_given else options.lookahead
        self.lookahead_bytes = options.lookahead_bytes
        self.errors: list[tuple[str, BlobdataError]] = []
        self._channel: PlanChannel | None = None
        # What the training process fetched for the workers it starts next (non-persistent workers:
        # the next epoch's first batches); forked workers find it in their copy. Never pickled.
        self._handoff: dict[int, Any] = {}
        self._proc: ProcessState | None = None
        self._peers: PeerTable | None = join_peers(self, peers, cache)
        if self._peers is not None and not options.lookahead_given:  # see _peers.PEERS_LOOKAHEAD
            self.lookahead = min(self.lookahead, PEERS_LOOKAHEAD)
        return given

    # -- what a dataset says -----------------------------------------------------------------------
    def _settings_repr(self) -> str:
        """``, storage_options=..., cache=...`` for a repr: secrets redacted, the cache as ``cache=``."""
        opts = f", storage_options={redact(self._storage_options)}" if self._storage_options else ""
        return opts + (f", cache={self.cache!r}" if self.cache is not None else "")

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetch what a batch reads all at once (what is not staged requested concurrently), then make
        its samples (:meth:`_make`). In a persistent worker, the first batch of an epoch may have been
        built ahead (:mod:`blobdata._dataset.ahead`)."""
        idx = [int(i) for i in indices]
        seed = getattr(indices, "seed", None)  # a blobdata loader's batch keys its samples' draws
        proc = self._process()
        built, proc.built = proc.built, None
        out = built.take(idx, seed) if built is not None else None
        v = _stats.rec()
        if out is not None and built is not None:
            v[_stats.BUILT_AHEAD] += 1
            v[_stats.STAGED] += built.staged[0]  # this epoch's: counted now, not while it was built
            self._advance(proc, idx, seed)  # the look-ahead goes on along the new epoch
        else:
            out = self._make(idx, self._fetched(idx, seed), seed)
        v[_stats.SERVED] += len(out)
        v[_stats.BATCHES] += 1
        staging = proc.lookahead
        nxt = staging.next_first if staging is not None else None
        if staging is not None and nxt is not None:  # its last batch of the epoch: build the next one
            staging.next_first = None
            proc.built = BuiltAhead(*nxt, functools.partial(self._build_ahead, *nxt))
        return out

    def _make(
        self, idx: list[int], datas: list[Any], seed: int | None, stop: threading.Event | None = None
    ) -> list[Any]:
        """The samples of ``idx`` from what was fetched for them (bytes, or the exception met), their
        augmentation keyed by ``seed``; a bad one goes to :meth:`_failed`. ``stop``: building ahead,
        checked between samples."""
        raise NotImplementedError

    def _build_ahead(
        self, idx: list[int], seed: int | None, stop: threading.Event, staged: list[int]
    ) -> list[Any]:
        # Its fetches are given up (cancelled) as soon as the batch will not be used: the worker,
        # given another batch, waits for this thread, not for a slow or retrying request.
        with _stats.for_next_epoch():  # its reads are the next epoch's, not this one's
            fetching = submit(self._gather(idx, seed, staged=staged))
        while True:
            try:
                datas = fetching.result(timeout=0.05)
                break
            except concurrent.futures.TimeoutError:
                if stop.is_set():
                    fetching.cancel()
                    raise Stopped from None
        return self._make(idx, datas, seed, stop)

    def _failed(self, url: str, exc: BlobdataError, stop: threading.Event | None) -> None:
        """A sample could not be made (call in its ``except``): re-raised with ``on_error="raise"``, and
        while building ahead (the batch is then made again when asked for, and fails there); else
        reported and skipped."""
        if stop is not None:
            raise Stopped from exc
        if self.on_error == "raise":
            if torch.utils.data.get_worker_info() is not None:
                note_fields(exc)  # the DataLoader re-raises it in the main process from its text
            raise exc
        self._report(url, exc)

    async def _load(self, i: int, *, checked: bool = False) -> Any:
        """What sample ``i`` reads (its bytes, or every member's), one look-ahead unit; ``checked``: the
        look-ahead found it missing in the cache (it is not looked up there again)."""
        raise NotImplementedError

    def _size_of(self, i: int) -> int:
        """Bytes sample ``i`` reads, as far as known (the look-ahead's byte budget)."""
        raise NotImplementedError

    def _objects(self, indices: list[int]) -> Objects:
        """The objects the samples ``indices`` read (a batch's, for the reads that need no loop)."""
        raise NotImplementedError

    def _object_error(self, row: int, exc: BlobdataError) -> BlobdataError:
        """The error to report for object ``row`` (of :meth:`_objects`) that could not be read."""
        return exc

    def _cached(self, indices: list[int]) -> list[bool]:
        """Whether each sample's objects are all in the node cache: one index lookup for them all, on
        the loop, for the look-ahead (what it finds is not fetched, but read by the thread serving its
        batch, which uses the bytes: allocated and freed in one thread, with one lookup per batch).
        Samples this process read from an ``"admit"`` cache are known held (:class:`Held`): not looked
        up again."""
        proc = self._process()
        cache = proc.cache
        if cache is None:
            return [False] * len(indices)
        held = proc.held
        ask = held.unknown(indices) if held is not None else indices
        if not ask:
            return [True] * len(indices)
        obj = self._objects(ask)
        t = time.perf_counter()
        found = cache.has_many(list(zip(obj.urls, obj.ids, strict=True)))
        _stats.rec()[_stats.CACHE_S] += time.perf_counter() - t
        if proc.peers is not None:  # what is missing is read from its home: scored here, as a batch
            note_homes(proc, obj, found, 4 * self.lookahead)
        if obj.offsets is not None:
            found = [all(found[a:b]) for a, b in itertools.pairwise(obj.offsets)]
        if ask is indices:
            return found
        answer = dict(zip(ask, found, strict=True))
        return [answer.get(i, True) for i in indices]

    @property
    def cache_dir(self) -> str | None:
        """The cache's directory, or None without a cache."""
        return self.cache.directory if self.cache is not None else None

    @property
    def cache_size(self) -> int | None:
        """The cache's size bound in bytes, or None without a cache."""
        return self.cache.size_limit if self.cache is not None else None

    # -- pickling: per-process state stays behind --------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc"] = None
        state["errors"] = []
        state["_handoff"] = {}
        return state

    # -- reading -----------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        index %= n
        if self.on_error == "raise":
            return self.__getitems__([index])[0]
        for attempt in range(min(n, 16)):
            got = self.__getitems__([(index + attempt) % n])
            if got:
                return got[0]
        raise BlobdataError(
            f"16 consecutive samples from index {index} of {self._url} failed; see the warnings"
        )

    def _report(self, url: str, exc: BlobdataError) -> None:
        self.errors.append((url, exc))
        if self._channel is not None and torch.utils.data.get_worker_info() is not None:
            SkipLog(self._channel.path).record(url, exc)  # for the training process's ds.errors
        _stats.rec()[_stats.ERRORS] += 1
        log.warning("blobdata: skipped bad sample %s: %s", printable(url), printable(exc))
        if callable(self.on_error):
            self.on_error(url, exc)

    def _process(self) -> ProcessState:
        proc = self._proc
        if proc is None or proc.pid != _process.pid():
            proc = self._proc = ProcessState(self)
        return proc

    def _fetched(self, indices: list[int], seed: int | None = None) -> list[Any]:
        """What the samples ``indices`` read: what needs no loop read here (local files, cache hits,
        what the look-ahead read ahead from the cache: :mod:`blobdata._dataset.reads`), the rest fetched
        all at once on the loop; the time is counted as fetch wait."""
        t = time.perf_counter()
        proc = self._process()
        if self._handoff:  # a new worker's first batch: what was fetched for it becomes its own
            self._adopt_handoff(proc)
        datas = read_batch(self, proc, indices)
        self._read_rest(proc, indices, seed, datas, [k for k, d in enumerate(datas) if d is PENDING])
        _stats.rec()[_stats.FETCH_WAIT_S] += time.perf_counter() - t
        return datas

    def _read_rest(
        self, proc: ProcessState, indices: list[int], seed: int | None, datas: list[Any], rest: list[int]
    ) -> None:
        """``datas[k]`` for each ``k`` of ``rest`` (what the thread could not read itself) from the loop;
        where there is none, the look-ahead moves past the batch ``indices`` from here."""
        if rest:
            got = run(self._gather([indices[k] for k in rest], seed, batch=indices))
            for k, data in zip(rest, got, strict=True):
                datas[k] = data
        elif self._channel is not None and self.lookahead > 0:
            self._advance(proc, indices, seed)

    async def _fetch_object(
        self, url: str, size: int | None, identity: str, *, learn: bool = False, checked: bool = False
    ) -> tuple[bytes, str]:
        """One object's ``(bytes, identity)``: from the cache (unless ``checked``: the look-ahead found
        it missing there), else from the bucket (then offered to the cache under ``identity``). With
        ``learn`` and ``identity`` "" (not known yet), the store's answer is read whatever it is and
        offered under the identity the store gave, which is returned."""
        proc = self._process()
        v = _stats.rec()
        unknown = learn and not identity
        if proc.cache is not None and not unknown and not checked:
            # Inline on the loop thread: a hit is one index read and one file read (~50 us), less
            # than a hop to an executor thread costs.
            t = time.perf_counter()
            data = proc.cache.get(url, identity)
            v[_stats.CACHE_S] += time.perf_counter() - t
            if data is not None:
                v[_stats.N_FROM_CACHE if _stats.next_epoch() else _stats.FROM_CACHE] += 1
                v[_stats.BYTES_CACHE] += len(data)
                return data, identity
        if proc.peers is not None and identity and size is not None:  # from its home node's cache
            return await read_from_home(proc, proc.peers, url, size, identity), identity
        data, got = await proc.engine.fetch(url, size=size, identity=None if unknown else identity)
        v[_stats.N_FROM_BUCKET if _stats.next_epoch() else _stats.FROM_BUCKET] += 1
        key = got if unknown else identity
        # offer() never waits: written in batches off this path, or dropped (and counted) when behind.
        if proc.writer is not None and (key or not unknown) and not proc.writer.offer(url, key, data):
            v[_stats.CACHE_DROPPED] += 1
        return data, key

    def _lookahead(self, proc: ProcessState) -> LookAhead | None:
        if self.lookahead <= 0:
            return None
        if proc.lookahead is None:
            # With a cache, the look-ahead looks its samples up there first (:meth:`_cached`) and fetches
            # only those it misses, which are not looked up again.
            cached = self._cached if self._marks_present() else None
            fetch = functools.partial(self._load, checked=True) if cached is not None else self._load
            many = self._loads_from_homes(proc) if cached is not None and proc.peers is not None else None
            proc.lookahead = LookAhead(
                fetch, self._size_of, max_items=self.lookahead, max_bytes=self.lookahead_bytes,
                cached=cached, handed=proc.handed, fetch_many=many,
            )  # fmt: skip
        return proc.lookahead

    def _loads_from_homes(
        self, proc: ProcessState
    ) -> Callable[[list[int]], list[asyncio.Future[Any]]] | None:
        """How the look-ahead starts its misses' reads from their homes as one batch (indices -> a
        future of each one's :meth:`_load`), where this dataset can; None: a task per sample."""
        return None

    async def _gather(
        self,
        indices: list[int],
        seed: int | None = None,
        *,
        staged: list[int] | None = None,
        batch: list[int] | None = None,
    ) -> list[Any]:
        """What ``indices`` (keyed by ``seed``) read, staged or fetched now; then the look-ahead moves
        past the batch they belong to (``batch``, by default ``indices``). For a batch built ahead
        (``staged`` given) the look-ahead stays (it is not this epoch's batch) and the samples taken
        from it are added to ``staged[0]``, for its epoch to count when it is served."""
        proc = self._process()
        staging = proc.lookahead
        tasks: list[asyncio.Future[Any]] = []
        staged_n = 0
        for i in indices:
            taken = staging.take(i) if staging is not None else None
            staged_n += taken is not None
            tasks.append(taken if taken is not None else asyncio.ensure_future(self._load(i)))
        if staged is not None:
            staged[0] += staged_n
        else:  # after this batch's own requests, so that requests start in the sampler's order
            _stats.rec()[_stats.STAGED] += staged_n
            self._advance_on_loop(proc, batch if batch is not None else indices, seed)
        return await self._await_all(indices, tasks)

    async def _await_all(self, indices: list[int], tasks: list[asyncio.Future[Any]]) -> list[Any]:
        """Each task's result, or its exception (as ``gather(..., return_exceptions=True)``), the tasks
        cancelled with this one; those done already (the look-ahead's, mostly) are not each waited
        for through a callback and a turn of the loop."""
        waiting = [t for t in tasks if not t.done()]
        if waiting:
            try:
                await asyncio.wait(waiting)
            except asyncio.CancelledError:
                for t in tasks:
                    t.cancel()
                raise
        return [_outcome(t) for t in tasks]

    def _not_kept(self, indices: list[int]) -> list[int]:  # what is handed over to new workers
        return not_kept(self, indices)

    def _marks_present(self) -> bool:  # whether the look-ahead asks _cached what the batch reads itself
        return self.cache is not None

    def _advance_on_loop(self, proc: ProcessState, indices: list[int], seed: int | None) -> None:
        channel = self._channel
        staging = self._lookahead(proc) if channel is not None else None
        if staging is not None and channel is not None:
            info = torch.utils.data.get_worker_info()
            staging.advance(channel, indices, info.num_workers if info is not None else 1, seed)

    # The next epoch's first batches, for workers forked at its start: see .handover.
    def _hand_over(self, indices: Sequence[int]) -> None:
        handover.start(self, indices)

    def _settle_hand_over(self, wait_s: float = 2.0) -> None:
        handover.settle(self, wait_s)

    def _adopt_handoff(self, proc: ProcessState) -> None:
        handover.adopt(self, proc)

    def _drop_handoff(self) -> None:
        handover.drop(self)

    def _advance(self, proc: ProcessState, indices: list[int], seed: int | None) -> None:
        """Move the look-ahead past ``indices`` (from outside the loop; it runs there, in order). The
        next batch waits for it to be done (:attr:`ProcessState.advancing`) before it reads anything
        itself: what the look-ahead stages is then never also read by the batch."""
        done = proc.advancing = threading.Event()

        def advance() -> None:
            try:
                self._advance_on_loop(proc, indices, seed)
            finally:
                done.set()

        get_loop().call_soon_threadsafe(advance)

    # -- loaders that know the order ---------------------------------------------------------------
    def dataloader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        device: str | torch.device | None = None,
        gpu_transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> BlobLoader:
        """A ``torch.utils.data.DataLoader`` (a :class:`~blobdata.BlobLoader`) whose order blobdata sees,
        so that each process fetches ahead of the batches it will be given.

        Takes DataLoader's arguments with their meaning: the same arguments and the same seeded
        ``generator`` give exactly the batches ``DataLoader(self, ...)`` gives. Use
        ``sampler=DistributedSampler(ds)`` for DDP (each rank then fetches only its own indices) and
        call ``sampler.set_epoch(e)`` as usual; ``blobdata.ElasticDistributedSampler`` gives the same
        order and resumes at another world size. The loader has ``state_dict``/``load_state_dict``.
        ``sampler="partitioned"``: a ``blobdata.PartitionedSampler(ds)`` (each node, one share, every epoch).

        ``device="cuda"`` with ``gpu_transform=`` (e.g. ``blobdata.gpu.TrainTransform(224)``) is the GPU
        path: workers only fetch bytes, and the training process decodes each batch on the GPU
        (hardware JPEG decoder where there is one, Pillow for what it refuses) and applies
        ``gpu_transform`` to it on a side CUDA stream, one batch ahead of the loop; batches are
        ``(images, targets)`` on the device. The dataset must then have no ``transform`` or custom
        ``loader`` (``target_transform`` still runs in the workers). ``device="cpu"`` runs the same path
        on the CPU. Needs ``pip install 'blobdata[gpu]'`` for CUDA; see :mod:`blobdata.gpu`.
        """
        if isinstance(kwargs.get("sampler"), str):
            kwargs["sampler"] = named_sampler(self, kwargs["sampler"], shuffle)
            shuffle = None
        # All by keyword: Lightning re-makes a loader from the arguments it was made with, adding its
        # own sampler= and shuffle=, which must not collide with positional ones.
        return BlobLoader(
            self, batch_size=batch_size, shuffle=shuffle, device=device, gpu_transform=gpu_transform, **kwargs
        )

    def _attach(self, channel: PlanChannel) -> None:
        """Read the plans of the loader that owns ``channel`` (the latest loader made, in this process)."""
        self._channel = channel
        _stats.attach(channel.path)  # this process's counters go to the loader's stats from now on

    def _drop_staged(self) -> None:
        """This process's look-ahead drops what it fetches for an epoch that was abandoned (a loop that
        broke out of it): its requests are cancelled rather than left to run, and retry, unused."""
        proc = self._proc
        if proc is not None and proc.pid == _process.pid() and proc.lookahead is not None:
            get_loop().call_soon_threadsafe(proc.lookahead.clear)

    def close(self) -> None:
        """Drop this process's staged data and cache handle (they are recreated on next use)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.pid == _process.pid():
            if proc.built is not None:
                proc.built.take([], None)  # stopped, and the global generators put back
            if proc.lookahead is not None:
                get_loop().call_soon_threadsafe(proc.lookahead.clear)
            if proc.writer is not None:
                proc.writer.flush()
            if proc.cache is not None:
                proc.cache.close()
            proc.close_engine()


def _outcome(task: asyncio.Future[Any]) -> Any:
    """A done task's result, or its exception (a cancelled one's: CancelledError), as gather gives."""
    if task.cancelled():
        return asyncio.CancelledError()
    exc = task.exception()
    return exc if exc is not None else task.result()

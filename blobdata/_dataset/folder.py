"""``FolderDataset``: torchvision's ``ImageFolder`` contract over a bucket URL.

Where each byte comes from, in order: the look-ahead stage (:mod:`blobdata._fetch.lookahead`), the local
cache (:mod:`blobdata._cache`), the bucket (:mod:`blobdata._fetch`). The sample table is a compact
:class:`~blobdata._listing.Manifest` of numpy arrays, so forked DataLoader workers share it instead of
copying it page by page. Everything that talks to the network (the fetch engine, the cache handle, the
staging area) is created lazily in each process and recreated when the process id changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch.utils.data

from .. import _process
from .._cache import BlobCache, CacheWriter
from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions, parse_size
from .._decode import decode, decode_with, default_loader
from .._errors import BlobdataError, ConfigError, note_fields
from .._fetch import FetchEngine, LookAhead, PlanChannel
from .._listing import Manifest, listing_params, load_or_list, shared_manifest
from .._loop import get_loop, run, submit
from .._metrics import SkipLog
from .._metrics import stats as _stats
from .._sampling import enter_sample, leave_sample
from .._stores.options import redact, resolve_storage_options
from .._url import parse_url
from ..gpu._jpeg import prepare as prepare_raw
from .imagefolder import Building, ImageFolderContract, apply_overrides, building, every, path_prefix
from .loader import BlobLoader

__all__ = ["FolderDataset"]

log = logging.getLogger("blobdata")

OnError = Literal["raise", "skip"] | Callable[[str, BaseException], None]


def _resolve_cache(
    cache: str | os.PathLike[str] | BlobCache | None,
    cache_dir: str | os.PathLike[str] | None,
    cache_size: int | str | None,
    cache_policy: Literal["admit", "lru"] | None,
) -> BlobCache | None:
    """The dataset's cache from ``cache=`` (or the deprecated spellings), opened once here so that an
    unusable directory is an error now, not a warning per worker later."""
    if cache_dir is not None or cache_size is not None or cache_policy is not None:
        warnings.warn(
            "FolderDataset(cache_dir=, cache_size=, cache_policy=) are deprecated: pass cache=DIR, or "
            "cache=BlobCache(DIR, size_limit=..., policy=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        if cache is not None:
            raise ConfigError(
                "pass cache= only (cache_dir=, cache_size= and cache_policy= are its old names)"
            )
        if cache_dir is None:
            return None
        cache = BlobCache(cache_dir, size_limit=cache_size or "100GB", policy=cache_policy or "admit")
    if cache is None or isinstance(cache, BlobCache):
        return cache
    if not isinstance(cache, (str, os.PathLike)):
        raise ConfigError(f"cache must be a directory or a BlobCache, got {type(cache).__name__}")
    return BlobCache(cache)


class _Process:
    """Per-process handles: fetch engine, cache, staging area. Never pickled."""

    def __init__(self, ds: FolderDataset) -> None:
        self.pid = _process.pid()
        self.engine = FetchEngine(
            ds.fetch_options,
            ds._protocol,
            resolve_storage_options(ds._protocol, ds._storage_options),
            root=ds.url,
        )
        # The dataset's BlobCache (checked usable at construction) reopens its index in each process.
        self.cache: BlobCache | None = ds.cache
        self.writer = CacheWriter(self.cache, on_stored=_count_stored) if self.cache is not None else None
        self.lookahead: LookAhead | None = None
        # Connections belong to this process's loop: close them there when this state goes away
        # (the engine closes them itself at interpreter exit).
        weakref.finalize(self, _close_engine, self.engine, self.pid)


def _count_stored(n: int) -> None:
    _stats.rec()[_stats.CACHE_STORED] += n


def _close_engine(engine: FetchEngine, pid: int) -> None:
    if _process.pid() == pid:
        with contextlib.suppress(RuntimeError):  # interpreter shutting down: the loop is gone
            submit(engine.aclose())


class FolderDataset(ImageFolderContract, torch.utils.data.Dataset[Any]):
    """A folder of class sub-folders in a bucket, with the contract of torchvision's ``ImageFolder``.

    ``root`` is any supported URL (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://`` or a local
    path). ``transform``, ``target_transform``, ``loader``, ``extensions``, ``is_valid_file`` and
    ``allow_empty`` behave as in ImageFolder; ``loader`` receives a binary file object holding the
    object's bytes (``name`` is its URL) instead of a path. Read through :meth:`dataloader`, a
    transform's random draws can be keyed by (loader seed, epoch, URL): :func:`blobdata.sample_rng`.
    Keyword-only settings:

    storage_options:  fsspec options of the backend (endpoint, credentials); the environment's usual
                      variables apply where these are silent.
    cache:            a local directory (an SSD) that keeps fetched objects across epochs and jobs
                      (100GB, policy "admit"), or a :class:`BlobCache` for other settings
                      (``BlobCache(dir, size_limit="500GB", policy="lru")``); None (default) caches
                      nothing. A directory that cannot be used raises :class:`CacheError` here; a full
                      disk later only stops caching. (``cache_dir=``, ``cache_size=`` and
                      ``cache_policy=`` are its deprecated former spellings.)
    manifest:         a precomputed listing (local path or URL) to use instead of listing the bucket.
    refresh:          list the bucket again even if a remembered listing exists (default False).
    listing_max_age:  how long a remembered bucket listing is reused, seconds or ``"1d"`` (default
                      ``"7d"``; None: forever). Local folders are listed afresh every time.
    on_error:         ``"raise"`` (default): a sample that cannot be fetched or decoded raises an error
                      naming its URL. ``"skip"``: it is dropped from its batch (``__getitem__`` returns the
                      next good sample) and reported as a warning on the ``blobdata`` logger and in
                      :attr:`errors`. A callable ``(url, exc)`` skips and is called for each bad sample.
    fetch_options:    :class:`FetchOptions` (requests in flight, timeout, attempts, part size).
    lookahead:        samples each process fetches ahead of the sampler's order (default 1024; 0 disables);
                      effective with loaders from :meth:`dataloader`. Each epoch starts two batches
                      ahead and doubles per batch up to this depth, so that the first batch does
                      not wait behind a burst of requests.
    lookahead_bytes:  bytes each process may hold staged ahead (default 256MiB).
    share_listing:    under torchrun or an initialised process group, rank 0 lists and the others
                      receive its manifest (default True; a collective call: pass False for a dataset
                      made on one rank only).
    """

    _raw = False  # the device path's workers: samples are (bytes, url, target), see _raw_view

    def __init__(
        self,
        root: str | os.PathLike[str],
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        loader: Callable[[Any], Any] | None = None,
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache: str | os.PathLike[str] | BlobCache | None = None,
        manifest: str | os.PathLike[str] | None = None,
        refresh: bool = False,
        listing_max_age: float | str | None = DEFAULT_LISTING_MAX_AGE,
        on_error: OnError = "raise",
        fetch_options: FetchOptions | None = None,
        lookahead: int = 1024,
        lookahead_bytes: int | str = "256MiB",
        share_listing: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_size: int | str | None = None,
        cache_policy: Literal["admit", "lru"] | None = None,
    ) -> None:
        given = os.path.expanduser(root) if isinstance(root, str) else root
        url = parse_url(given)
        self.root = given  # as given, as ImageFolder keeps it; the canonical URL is `url`
        self._url = str(url)
        local = os.fspath(given) if url.protocol == "file" else None
        self._local_root = url.prefix if local is not None and local.startswith("file://") else local
        self.cache = _resolve_cache(cache, cache_dir, cache_size, cache_policy)
        if on_error not in ("raise", "skip") and not callable(on_error):
            raise ConfigError(f"on_error must be 'raise', 'skip' or a callable, got {on_error!r}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError(f"lookahead must be a non-negative number of samples, got {lookahead!r}")
        self._protocol = url.protocol
        self._storage_options = dict(storage_options or {})
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader if loader is not None else default_loader
        self.extensions = extensions
        self.fetch_options = fetch_options if fetch_options is not None else FetchOptions()
        self.on_error = on_error
        self.lookahead = lookahead
        self.lookahead_bytes = parse_size(lookahead_bytes, name="lookahead_bytes")
        self.errors: list[tuple[str, BlobdataError]] = []
        cls = type(self)
        own_make = cls.make_dataset is not ImageFolderContract.make_dataset
        own_find = own_make or cls.find_classes is not ImageFolderContract.find_classes
        # A make_dataset override chooses among every object below the class folders.
        exts, valid = (None, every) if own_make else (extensions, is_valid_file)
        make = functools.partial(
            load_or_list,
            self._url,
            storage_options=resolve_storage_options(self._protocol, self._storage_options),
            refresh=refresh,
            manifest=os.fspath(manifest) if manifest is not None else None,
            extensions=exts,
            is_valid_file=valid,
            allow_empty=allow_empty or own_find,
            fetch_options=self.fetch_options,
            max_age=listing_max_age,
            local_root=self._local_root,
        )
        key = repr(listing_params(exts, valid))
        listed = shared_manifest(self._url, make, key=key) if share_listing else make()
        self._manifest, self._targets = listed, listed.targets
        self.classes: list[str] = list(listed.classes)
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self._targets_list: list[Any] | None = None  # `targets` once asked for, or as assigned
        self._imgs: Any = None  # `imgs` as assigned
        if own_find:
            token = building.set(Building(self._url, listed, self._local_root))
            try:
                got = apply_overrides(self, own_make, extensions, is_valid_file, allow_empty)
                self._manifest, self._targets, self.classes, self.class_to_idx = got
            finally:
                building.reset(token)
        self._channel: PlanChannel | None = None
        self._proc: _Process | None = None

    @property
    def cache_dir(self) -> str | None:
        """The cache's directory, or None without a cache."""
        return self.cache.directory if self.cache is not None else None

    @property
    def cache_size(self) -> int | None:
        """The cache's size bound in bytes, or None without a cache."""
        return self.cache.size_limit if self.cache is not None else None

    # -- ImageFolder compatibility -------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        """The listing this dataset reads (compact arrays; save it to share it with other nodes)."""
        return self._manifest

    def __len__(self) -> int:
        return len(self._manifest)

    def __repr__(self) -> str:
        opts = f", storage_options={redact(self._storage_options)}" if self._storage_options else ""
        cache = f", cache_dir={self.cache_dir!r}, cache_size={self.cache_size}" if self.cache_dir else ""
        return (
            f"FolderDataset({self._url!r}, samples={len(self)}, classes={len(self.classes)}{opts}{cache}, "
            f"transform={self.transform!r})"
        )

    # -- pickling: per-process state stays behind --------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_proc"] = None
        state["errors"] = []
        state["_targets_list"] = None  # the workers load from the arrays
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

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Fetch all samples of a batch at once (misses requested concurrently), then decode them."""
        idx = [int(i) for i in indices]
        clock = time.perf_counter
        t = clock()
        datas = run(self._gather(idx))
        v = _stats.rec()
        v[_stats.FETCH_WAIT_S] += clock() - t
        decoding = transforming = 0.0
        out: list[Any] = []
        m, targets = self._manifest, self._targets
        local = path_prefix(m, self._local_root) if self._local_root is not None else None
        decode_aware = hasattr(self.transform, "decode_and_apply")
        raw = self._raw
        seed = getattr(indices, "seed", None)  # a blobdata loader's batch keys its samples' draws
        for i, data in zip(idx, datas, strict=True):
            url = m.url(i)
            token = enter_sample(seed, url)  # blobdata.sample_rng() and our transforms draw from it
            try:
                if isinstance(data, BaseException):
                    raise data
                t = clock()
                if raw:  # the device path: bytes of JPEGs for the GPU, the rest decoded here (blobdata.gpu)
                    sample = prepare_raw(data, url)
                    decoding += clock() - t
                elif decode_aware:  # the transform decodes only what it needs (blobdata.transforms)
                    sample = decode_with(self.transform, data, url)
                    decoding += clock() - t
                elif self.transform is not None:
                    sample = decode(data, url, self.loader, path=local and local + m.relkey(i))
                    t2 = clock()
                    decoding += t2 - t
                    sample = self.transform(sample)
                    transforming += clock() - t2
                else:
                    sample = decode(data, url, self.loader, path=local and local + m.relkey(i))
                    decoding += clock() - t
                target: Any = int(targets[i])
                if self.target_transform is not None:
                    target = self.target_transform(target)
            except BlobdataError as exc:
                if self.on_error == "raise":
                    if torch.utils.data.get_worker_info() is not None:
                        note_fields(exc)  # the DataLoader re-raises it in the main process from its text
                    raise
                self._report(url, exc)
                continue
            finally:
                leave_sample(token)
            out.append((sample, url, target) if raw else (sample, target))
        v[_stats.DECODE_S] += decoding
        v[_stats.TRANSFORM_S] += transforming
        v[_stats.SERVED] += len(out)
        v[_stats.BATCHES] += 1
        return out

    def _report(self, url: str, exc: BlobdataError) -> None:
        self.errors.append((url, exc))
        if self._channel is not None and torch.utils.data.get_worker_info() is not None:
            SkipLog(self._channel.path).record(url, exc)  # for the training process's ds.errors
        _stats.rec()[_stats.ERRORS] += 1
        log.warning("blobdata: skipped bad sample %s: %s", url, exc)
        if callable(self.on_error):
            self.on_error(url, exc)

    def _process(self) -> _Process:
        proc = self._proc
        if proc is None or proc.pid != _process.pid():
            proc = self._proc = _Process(self)
        return proc

    async def _load(self, i: int) -> bytes:
        """Bytes of sample ``i``: from the cache, else from the bucket (then offered to the cache)."""
        proc = self._process()
        m = self._manifest
        url, identity = m.url(i), m.identity(i)
        v = _stats.rec()
        if proc.cache is not None:
            # Inline on the loop thread: a hit is one index read and one file read (~50 us), less
            # than a hop to an executor thread costs.
            t = time.perf_counter()
            data = proc.cache.get(url, identity)
            v[_stats.CACHE_S] += time.perf_counter() - t
            if data is not None:
                v[_stats.FROM_CACHE] += 1
                v[_stats.BYTES_CACHE] += len(data)
                return data
        data, _ = await proc.engine.fetch(url, size=m.size(i), identity=identity)
        v[_stats.FROM_BUCKET] += 1
        # offer() never waits: written in batches off this path, or dropped (and counted) when behind.
        if proc.writer is not None and not proc.writer.offer(url, identity, data):
            v[_stats.CACHE_DROPPED] += 1
        return data

    def _lookahead(self, proc: _Process) -> LookAhead | None:
        if self.lookahead <= 0:
            return None
        if proc.lookahead is None:
            proc.lookahead = LookAhead(
                self._load,
                lambda i: int(self._manifest.sizes[i]),
                max_items=self.lookahead,
                max_bytes=self.lookahead_bytes,
            )
        return proc.lookahead

    async def _gather(self, indices: list[int]) -> list[bytes | BaseException]:
        proc = self._process()
        ahead = proc.lookahead
        tasks: list[asyncio.Future[bytes]] = []
        staged_n = 0
        for i in indices:
            staged = ahead.take(i) if ahead is not None else None
            staged_n += staged is not None
            tasks.append(staged if staged is not None else asyncio.ensure_future(self._load(i)))
        _stats.rec()[_stats.STAGED] += staged_n
        # After this batch's own requests, so that the order requests start in is the sampler's.
        channel = self._channel
        ahead = self._lookahead(proc) if channel is not None else None
        if ahead is not None and channel is not None:
            info = torch.utils.data.get_worker_info()
            ahead.advance(channel, indices, info.num_workers if info is not None else 1)
        return list(await asyncio.gather(*tasks, return_exceptions=True))

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
            kwargs["sampler"] = _named_sampler(self, kwargs["sampler"], shuffle)
            shuffle = None
        # All by keyword: Lightning re-makes a loader from the arguments it was made with, adding its
        # own sampler= and shuffle=, which must not collide with positional ones.
        return BlobLoader(
            self, batch_size=batch_size, shuffle=shuffle, device=device, gpu_transform=gpu_transform, **kwargs
        )

    def _raw_view(self) -> FolderDataset:
        """This dataset returning ``(bytes, url, target)`` samples (the device path's workers)."""
        if self.transform is not None:
            raise ConfigError(
                "with device=, the workers return bytes and gpu_transform= makes the batch: build the "
                f"dataset without transform= (it has {self.transform!r})"
            )
        if self.loader is not default_loader:
            raise ConfigError(
                "with device=, images are decoded by blobdata.gpu: build the dataset without loader="
            )
        view = copy.copy(self)  # shares the listing and the cache
        view.errors = self.errors  # and the skip list (copying goes through __getstate__, which empties it)
        view._raw = True
        return view

    def _attach(self, channel: PlanChannel) -> None:
        """Read the plans of the loader that owns ``channel`` (the latest loader made, in this process)."""
        self._channel = channel
        _stats.attach(channel.path)  # this process's counters go to the loader's stats from now on

    def close(self) -> None:
        """Drop this process's staged data and cache handle (they are recreated on next use)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.pid == _process.pid():
            if proc.lookahead is not None:
                get_loop().call_soon_threadsafe(proc.lookahead.clear)
            if proc.writer is not None:
                proc.writer.flush()
            if proc.cache is not None:
                proc.cache.close()
            proc.engine.close()


def _named_sampler(ds: FolderDataset, name: str, shuffle: bool | None) -> Any:
    if name != "partitioned":  # dataloader(sampler="partitioned"): the job's PartitionedSampler, seed 0
        raise ConfigError(f'sampler= takes a sampler or "partitioned", got {name!r}')
    from .._sampling import PartitionedSampler

    return PartitionedSampler(ds, shuffle=shuffle is not False)

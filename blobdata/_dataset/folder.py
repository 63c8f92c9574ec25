"""``FolderDataset``: torchvision's ``ImageFolder`` contract over a bucket URL.

Where each byte comes from, in order: the look-ahead stage (:mod:`blobdata._fetch.lookahead`), the local
cache (:mod:`blobdata._cache`), the bucket (:mod:`blobdata._fetch`). The sample table is a compact
:class:`~blobdata._listing.Manifest` of numpy arrays, so forked DataLoader workers share it instead of
copying it page by page. Everything that talks to the network (the fetch engine, the cache handle, the
staging area) is created lazily in each process and recreated when the process id changes.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.utils.data

from .._cache import BlobCache
from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions
from .._decode import decode, decode_with, default_loader
from .._errors import BlobdataError, ConfigError
from .._listing import Manifest, help_list, listing_params, load_or_list, shared_manifest
from .._metrics import stats as _stats
from .._peers import Peers
from .._sampling import enter_batch, leave_sample, this_nodes_share
from .._stores import list_requests, resolve_storage_options
from ..gpu._jpeg import prepare as prepare_raw
from .ahead import Stopped
from .base import BlobDatasetBase, OnError, legacy_keywords, resolve_cache
from .imagefolder import (
    Building,
    ImageFolderContract,
    apply_overrides,
    building,
    every,
    hidden_classes,
    path_prefix,
)
from .peering import start_from_homes
from .reads import Objects, ProcessState

__all__ = ["FolderDataset"]


class FolderDataset(ImageFolderContract, BlobDatasetBase, torch.utils.data.Dataset[Any]):
    """A folder of class sub-folders in a bucket, with the contract of torchvision's ``ImageFolder``.

    ``root`` is any supported URL (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://`` or a local
    path). ``transform``, ``target_transform``, ``loader``, ``extensions``, ``is_valid_file`` and
    ``allow_empty`` behave as in ImageFolder; ``loader`` receives a binary file object holding the
    object's bytes (``name`` is its URL) instead of a path. Read through :meth:`dataloader`, a
    transform's random draws can be keyed by (loader seed, epoch, URL): :func:`blobdata.sample_rng`.

    Most users need four arguments: ``root``, ``transform``, ``storage_options`` (or the environment)
    and ``cache``. The rest are rarely needed and grouped where they belong: how objects are fetched,
    retried and fetched ahead in :class:`FetchOptions` (``fetch_options=``), the cache's size bound
    and policy in :class:`BlobCache` (``cache=BlobCache(dir, size_limit=..., policy=...)``).
    Keyword-only settings:

    storage_options:  fsspec options of the backend (endpoint, credentials); the environment's usual
                      variables apply where these are silent.
    cache:            a local directory (an SSD) that keeps fetched objects across epochs and jobs
                      (its stored size bound, 100GB when new; policy "admit"), or a :class:`BlobCache`
                      for other settings (``BlobCache(dir, size_limit="500GB", policy="lru")``); None
                      (default) caches nothing. A directory that cannot be used raises
                      :class:`CacheError` here; a full disk later only stops caching.
    manifest:         a precomputed listing (local path or URL) to use instead of listing the bucket.
    refresh:          list the bucket again even if a remembered listing exists (default False).
    listing_max_age:  how long a remembered bucket listing is reused, seconds or ``"1d"`` (default
                      ``"7d"``; None: forever). Local folders are listed afresh every time.
    on_error:         ``"raise"`` (default): a sample that cannot be fetched or decoded raises an error
                      naming its URL. ``"skip"``: it is dropped from its batch (``__getitem__`` returns the
                      next good sample) and reported as a warning on the ``blobdata`` logger and in
                      :attr:`errors`. A callable ``(url, exc)`` skips and is called for each bad sample.
    fetch_options:    :class:`FetchOptions` (requests in flight, timeout, attempts, part size, the
                      look-ahead's depth and bytes).
    share_listing:    under torchrun or an initialised process group, the ranks list the bucket
                      together (each a part; rank 0 joins) and every rank gets the one manifest
                      (default True; a collective call: pass False for a dataset made on one rank only).
    peers:            the job's nodes serve each other their caches (:class:`~blobdata.Peers`; True for
                      its defaults): a sample this node's cache misses is read from the node that is
                      its home (CoorDL's partitioned caching, under any sampler). Needs ``cache=``.
                      Default None: ``BLOBDATA_PEERS=1`` turns it on; off otherwise. See docs/peers.md.
    skip_hidden:      skip class folders whose name starts with ``.`` or ``__`` (``.ipynb_checkpoints``,
                      macOS's ``__MACOSX``), as Hugging Face does (default False: they are classes, as in
                      torchvision's ImageFolder, with a warning naming each).
    node_share:       keep only this node's share of the listing (True, or ``{"seed": s}`` for a
                      :class:`PartitionedSampler` of another seed than 0): each node maps the entries
                      of the samples ``PartitionedSampler`` gives it (with ``mix=0``), O(its share) on
                      its disk and in its page cache, whatever the dataset's size. Read it with that
                      sampler; another sampler's index outside the share is a :class:`ConfigError`.

    Still accepted, for code written against earlier releases: ``lookahead=`` and
    ``lookahead_bytes=`` (the same as ``FetchOptions(lookahead=..., lookahead_bytes=...)``), and
    ``cache_dir=``, ``cache_size=``, ``cache_policy=`` (deprecated, with a warning: pass ``cache=``).
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
        share_listing: bool = True,
        skip_hidden: bool = False,
        node_share: bool | Mapping[str, int] = False,
        peers: bool | Peers | None = None,
        **legacy: Any,
    ) -> None:
        old = legacy_keywords("FolderDataset", legacy)
        given = self._setup(
            root,
            storage_options=storage_options,
            cache=resolve_cache(cache, old.get("cache_dir"), old.get("cache_size"), old.get("cache_policy")),
            on_error=on_error,
            fetch_options=fetch_options,
            lookahead=old.get("lookahead"),
            lookahead_bytes=old.get("lookahead_bytes"),
            peers=peers,
        )
        self.root = given  # as given, as ImageFolder keeps it; the canonical URL is `url`
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader if loader is not None else default_loader
        self.extensions = extensions
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
            allow_empty=allow_empty or own_find or skip_hidden,
            fetch_options=self.fetch_options,
            max_age=listing_max_age,
            local_root=self._local_root,
        )
        key = repr(listing_params(exts, valid))
        help = functools.partial(help_list, self._url, storage_options=make.keywords["storage_options"],
                                 fetch_options=self.fetch_options)  # the listing split across the job
        lists = list_requests()
        listed = shared_manifest(self._url, make, key=key, help=help) if share_listing else make()
        if not own_find:  # hidden and special class folders: skipped, or said (a subclass chose its own)
            listed = hidden_classes(listed, self._url, skip_hidden, allow_empty) or listed
        self.list_requests = list_requests() - lists  # LIST requests its listing took (remembered: none)
        if node_share:
            if own_find:
                raise ConfigError("node_share keeps only this node's samples: it cannot be combined with "
                                  "find_classes or make_dataset overrides")  # fmt: skip
            listed = this_nodes_share(listed, {} if node_share is True else dict(node_share))
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

    # -- ImageFolder compatibility -------------------------------------------------------------
    @property
    def node_share(self) -> dict[str, Any] | None:
        """The node share this dataset keeps (``node_share=``): seed, nodes, node; None: every sample."""
        return getattr(self._manifest, "spec", None)

    @property
    def manifest(self) -> Manifest:
        """The listing this dataset reads (compact arrays; save it to share it with other nodes)."""
        return self._manifest

    def __len__(self) -> int:
        return len(self._manifest)

    def __repr__(self) -> str:
        return (
            f"FolderDataset({self._url!r}, samples={len(self)}, classes={len(self.classes)}"
            f"{self._settings_repr()}, transform={self.transform!r})"
        )

    # -- pickling: per-process state stays behind --------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_targets_list"] = None  # the workers load from the arrays
        return state

    # -- reading -----------------------------------------------------------------------------------
    def _make(
        self, idx: list[int], datas: list[Any], seed: int | None, stop: threading.Event | None = None
    ) -> list[Any]:
        clock = time.perf_counter
        decoding = transforming = 0.0
        out: list[Any] = []
        m, targets = self._manifest, self._targets
        prefix = m.url_prefix
        read = self._process().urls  # the URLs the batch's read decoded already, if it did
        if read is not None and read[0] is idx:
            cut = len(prefix)
            relkeys = [u[cut:] for u in read[1]]
        else:
            relkeys = m.relkeys(idx)
        local = path_prefix(m, self._local_root) if self._local_root is not None else None
        decode_aware = hasattr(self.transform, "decode_and_apply")
        transform, loader, raw = self.transform, self.loader, self._raw
        keyed, token = enter_batch(seed)  # blobdata.sample_rng() and our transforms draw from it
        try:
            for i, data, key in zip(idx, datas, relkeys, strict=True):
                if stop is not None and stop.is_set():
                    raise Stopped
                url = prefix + key
                keyed.sample(url)
                try:
                    if isinstance(data, BaseException):
                        raise data
                    t = clock()
                    if raw:  # the device path: JPEG bytes for the GPU, the rest decoded here (blobdata.gpu)
                        sample = prepare_raw(data, url)
                        decoding += clock() - t
                    elif decode_aware:  # the transform decodes only what it needs (blobdata.transforms)
                        sample = decode_with(transform, data, url)
                        decoding += clock() - t
                    else:
                        sample = decode(data, url, loader, path=local and local + key)
                        t2 = clock()
                        decoding += t2 - t
                        if transform is not None:
                            sample = transform(sample)
                            transforming += clock() - t2
                    target: Any = int(targets[i])
                    if self.target_transform is not None:
                        target = self.target_transform(target)
                except BlobdataError as exc:
                    self._failed(url, exc, stop)
                    continue
                out.append((sample, url, target) if raw else (sample, target))
        finally:
            leave_sample(token)
        v = _stats.rec()
        v[_stats.DECODE_S] += decoding
        v[_stats.TRANSFORM_S] += transforming
        return out

    async def _load(self, i: int, *, checked: bool = False) -> bytes:
        """Bytes of sample ``i``: from the cache (unless ``checked`` already), else from the bucket
        (then offered to the cache)."""
        m = self._manifest
        return (await self._fetch_object(m.url(i), m.size(i), m.identity(i), checked=checked))[0]

    def _loads_from_homes(self, proc: ProcessState) -> Callable[[list[int]], list[asyncio.Future[Any]]]:
        proc.starts_noted = True  # what _cached finds missing is noted whole, by sample (note_homes)
        return functools.partial(start_from_homes, self, proc)

    def _objects(self, indices: list[int]) -> Objects:
        m = self._manifest
        return Objects(indices, None, m.urls(indices), m.sizes[indices].tolist(), m.identities(indices))

    def _size_of(self, i: int) -> int:
        return int(self._manifest.sizes[i])

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

"""``blobdata.warm``: :func:`warm_cache`, a folder's listing or a dataset's objects into a cache.

For a :class:`~blobdata.BlobDataset` (``blobdata.warm(ds)``): exactly the objects it reads, every member
of every sample, into its cache (or the one given), as ``blobdata warm URL --index FILE`` does.

The dataset's :meth:`~blobdata.BlobDataset.warm_objects` gives them as :func:`~blobdata._cli.warm.warm`
reads a listing (``root``, ``len``, ``sizes``, ``url(i)``, ``identity(i)``), plus what an index lacked:
an object whose identity is not known yet is read unpinned, its identity learned and remembered in the
cache as the dataset's own reads remember it, so that training pins the same version and hits the cache.
Shards (``rank``/``world_size``) are over objects: ``i % world_size == rank``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._config import FetchOptions
from .._errors import ConfigError
from .._stores import resolve_storage_options
from .._url import parse_url
from .warm import warm
from .warm_summary import WarmSummary

__all__ = ["dataset_for", "warm_cache", "warm_dataset", "warm_mixture"]


def warm_dataset(
    ds: Any,
    cache: Any,
    *,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = False,
    dry_run: bool = False,
    indices: Any = None,
    concurrency: int | None = None,
    cache_size: int | str | None = None,
    cache_policy: str | None = None,
    buffer_size: int | str = "256MiB",
) -> WarmSummary:
    """Warm ``ds``'s objects (``indices``: object rows, e.g. a node's share) into ``cache`` (default:
    ``ds.cache``)."""
    from .._cache import BlobCache, parse_limit

    cache = cache if cache is not None else ds.cache
    if cache is None:
        raise ConfigError(f"blobdata.warm(ds): {ds!r} has no cache; pass cache=DIR")
    policy: Any
    size: int | None
    if isinstance(cache, BlobCache):
        directory, size, policy = cache.directory, cache.size_limit, cache.policy
    else:
        directory = os.fspath(cache)
        # No size named: the cache's own stored bound (a new cache: the default).
        size = parse_limit(cache_size, name="cache_size") if cache_size is not None else None
        policy = cache_policy or "admit"
        if policy not in ("admit", "lru"):
            raise ConfigError(f"cache_policy must be 'admit' or 'lru', got {policy!r}")
    # A BlobDataset's objects (every member, what an index lacked learned); a FolderDataset's listing.
    objects = ds.warm_objects(directory) if hasattr(ds, "warm_objects") else ds.manifest
    try:
        return warm(
            ds.url, cache_dir=directory, cache_size=size, cache_policy=policy,
            storage_options=resolve_storage_options(parse_url(ds.url).protocol, ds._storage_options),
            concurrency=concurrency or ds.fetch_options.concurrency, rank=rank, world_size=world_size,
            manifest=objects, indices=indices, progress=progress, dry_run=dry_run, buffer_size=buffer_size,
        )  # fmt: skip
    finally:
        remember = getattr(objects, "remember", None)
        if remember is not None:
            remember()


def warm_mixture(
    mix: Any, cache: Any, *, rank: int = 0, world_size: int = 1, progress: bool = False, dry_run: bool = False
) -> WarmSummary:
    """Warm every source of a :class:`~blobdata.Mixture` into its cache (or ``cache``), one after the
    other; a local folder without a cache is left as it is (nothing to warm). The summary is their sum,
    each source's own in ``sources``."""
    parts: dict[str, WarmSummary] = {}
    for name, src in mix.sources.items():
        if cache is None and src.cache is None:
            if src._local_root is not None:
                continue
            raise ConfigError(
                f"blobdata.warm(mixture): source {name!r} ({src.url}) has no cache; give it one, or pass "
                "cache=DIR for every source"
            )
        parts[name] = warm_dataset(src, cache, rank=rank, world_size=world_size, progress=progress,
                                   dry_run=dry_run)  # fmt: skip
    return WarmSummary.of_sources(mix._url, parts)


def dataset_for(args: Any, url: str, storage_options: dict[str, Any], layout: Any) -> Any:
    """The BlobDataset ``blobdata warm|bench URL`` reads in ``layout`` (not class folders): as
    ``BlobDataset(URL, index=, metadata=, manifest=)``; a listing just made to find the layout is not
    made again for ``--refresh``."""
    from .._dataset import BlobDataset

    return BlobDataset(
        url, index=args.index, metadata=args.metadata, storage_options=storage_options,
        refresh=args.refresh and layout.listing is None, manifest=args.manifest, share_listing=False,
        fetch_options=FetchOptions(concurrency=args.concurrency),
    )  # fmt: skip


def warm_cache(
    url: str | Any,
    *,
    cache: str | os.PathLike[str] | Any = None,
    storage_options: Mapping[str, Any] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    extensions: tuple[str, ...] | None = None,
    fetch_options: FetchOptions | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = False,
    dry_run: bool = False,
) -> WarmSummary:
    """Fill a cache with a folder's objects from Python, as ``blobdata warm`` does (``blobdata.warm``).

    ``cache`` is a directory or a :class:`~blobdata.BlobCache` (its size limit and policy apply). The
    folder is listed as :class:`~blobdata.FolderDataset` lists it (remembered listing, ``manifest``,
    ``refresh``, ``extensions``); ``rank``/``world_size`` warm one node's share (samples ``i`` with
    ``i % world_size == rank``). Returns a :class:`WarmSummary` (objects fetched, skipped, failed...).
    ``blobdata.warm(ds)``: a :class:`~blobdata.BlobDataset`'s objects (see :mod:`.warm_objects`), a
    :class:`~blobdata.FolderDataset`'s listing, or every source of a :class:`~blobdata.Mixture`.
    """
    if hasattr(url, "source_sizes"):  # a Mixture: each of its sources
        return warm_mixture(url, cache, rank=rank, world_size=world_size, progress=progress, dry_run=dry_run)
    if hasattr(url, "warm_objects") or hasattr(url, "manifest"):  # a BlobDataset, a FolderDataset
        return warm_dataset(url, cache, rank=rank, world_size=world_size, progress=progress, dry_run=dry_run)
    if cache is None:
        raise ConfigError("blobdata.warm(url, cache=DIR): name the cache to fill")
    from .._cache import BlobCache
    from .._listing import load_or_list
    from .._stores import resolve_storage_options

    parsed = parse_url(url)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    options = fetch_options if fetch_options is not None else FetchOptions()
    m = load_or_list(
        str(parsed), storage_options=opts, manifest=manifest, refresh=refresh, extensions=extensions,
        fetch_options=options, progress=progress,
    )  # fmt: skip
    if isinstance(cache, BlobCache):
        directory, size, policy = cache.directory, cache.size_limit, cache.policy
    else:
        directory, size, policy = os.fspath(cache), None, "admit"
    return warm(
        str(parsed), cache_dir=directory, cache_size=size, cache_policy=policy, storage_options=opts,
        concurrency=options.concurrency, rank=rank, world_size=world_size, manifest=m, progress=progress,
        dry_run=dry_run,
    )  # fmt: skip

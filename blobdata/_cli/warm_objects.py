"""``blobdata.warm(ds)`` for a :class:`~blobdata.BlobDataset`: exactly the objects it reads, every member
of every sample, into its cache (or the one given), as ``blobdata warm URL --index FILE`` does.

The dataset's :meth:`~blobdata.BlobDataset.warm_objects` gives them as :func:`~blobdata._cli.warm.warm`
reads a listing (``root``, ``len``, ``sizes``, ``url(i)``, ``identity(i)``), plus what an index lacked:
an object whose identity is not known yet is read unpinned, its identity learned and remembered in the
cache as the dataset's own reads remember it, so that training pins the same version and hits the cache.
Shards (``rank``/``world_size``) are over objects: ``i % world_size == rank``.
"""

from __future__ import annotations

import os
from typing import Any

from .._config import parse_size
from .._errors import ConfigError
from .._stores.options import resolve_storage_options
from .._url import parse_url
from .warm import warm
from .warm_summary import WarmSummary

__all__ = ["warm_dataset"]


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
) -> WarmSummary:
    """Warm ``ds``'s objects (``indices``: object rows, e.g. a node's share) into ``cache`` (default:
    ``ds.cache``)."""
    from .._cache import BlobCache

    cache = cache if cache is not None else ds.cache
    if cache is None:
        raise ConfigError(f"blobdata.warm(ds): {ds!r} has no cache; pass cache=DIR")
    if isinstance(cache, BlobCache):
        directory, size, policy = cache.directory, cache.size_limit, cache.policy
    else:
        directory, size, policy = os.fspath(cache), parse_size("100GB"), "admit"
    objects = ds.warm_objects(directory)
    try:
        return warm(
            ds.url, cache_dir=directory, cache_size=size, cache_policy=policy,
            storage_options=resolve_storage_options(parse_url(ds.url).protocol, ds._storage_options),
            concurrency=concurrency or ds.fetch_options.concurrency, rank=rank, world_size=world_size,
            manifest=objects, indices=indices, progress=progress, dry_run=dry_run,
        )  # fmt: skip
    finally:
        objects.remember()

"""A dataset's settings as given: the keywords earlier releases took, the cache argument, a sampler
named to ``dataloader()``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from .._cache import BlobCache
from .._errors import ConfigError

__all__ = ["LEGACY_KEYWORDS", "legacy_keywords", "named_sampler", "resolve_cache"]


#: Keyword arguments datasets still accept besides their signature: the look-ahead's former
#: spellings (now :class:`FetchOptions` fields) and the cache's deprecated ones (now ``cache=``).
LEGACY_KEYWORDS = frozenset({"lookahead", "lookahead_bytes", "cache_dir", "cache_size", "cache_policy"})


def legacy_keywords(owner: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` checked against :data:`LEGACY_KEYWORDS`: an unknown keyword is a TypeError, as
    Python's own for a misspelt argument."""
    unknown = sorted(set(given) - LEGACY_KEYWORDS)
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return dict(given)


def resolve_cache(
    cache: str | os.PathLike[str] | BlobCache | None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    cache_policy: Literal["admit", "lru"] | None = None,
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
        cache = BlobCache(cache_dir, size_limit=cache_size, policy=cache_policy or "admit")
    if cache is None or isinstance(cache, BlobCache):
        return cache
    if not isinstance(cache, (str, os.PathLike)):
        raise ConfigError(f"cache must be a directory or a BlobCache, got {type(cache).__name__}")
    return BlobCache(cache)


def named_sampler(ds: Any, name: str, shuffle: bool | None) -> Any:
    """The sampler ``dataloader(sampler=name)`` names: ``"partitioned"``, the job's PartitionedSampler."""
    if name != "partitioned":  # dataloader(sampler="partitioned"): the job's PartitionedSampler, seed 0
        raise ConfigError(f'sampler= takes a sampler or "partitioned", got {name!r}')
    from .._sampling import PartitionedSampler

    sampler = PartitionedSampler(ds, shuffle=shuffle is not False)
    sampler.owned_by_loader = True  # the loader moves its epoch on, unless set_epoch is called
    return sampler

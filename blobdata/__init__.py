"""blobdata: train PyTorch models straight from a folder in a bucket.

>>> from blobdata import FolderDataset
>>> ds = FolderDataset("s3://bucket/imagenet/train", transform=t, cache="/mnt/nvme/blobdata")
>>> loader = ds.dataloader(batch_size=256, shuffle=True, num_workers=8)
"""

import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

if _sys.argv and _sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] in ("blobdata", "blobdata.exe"):
    # The `blobdata` console script imports this package before its own code runs: a Ctrl-C during
    # these imports (numpy, ...) is said in one line, as later ones are, not as a traceback.
    def _quiet_interrupt(kind: _Any, value: _Any, tb: _Any, _previous: _Any = _sys.excepthook) -> None:
        if issubclass(kind, KeyboardInterrupt):
            print("\nblobdata: interrupted", file=_sys.stderr)
        else:
            _previous(kind, value, tb)

    _sys.excepthook = _quiet_interrupt

from ._cache import BlobCache, CacheStats
from ._cli import WarmSummary
from ._cli import warm_cache as warm
from ._config import FetchOptions
from ._errors import (
    AccessDenied,
    BlobdataError,
    CacheError,
    ConfigError,
    DecodeError,
    EmptyDatasetError,
    FetchError,
    FetchTimeout,
    ManifestError,
    MissingMember,
    NotFound,
    ObjectChanged,
    Throttled,
)
from ._listing import Manifest
from ._listing import load_or_list as list_folder
from ._metrics import LoaderStats
from ._peers import Peers
from ._sampling import compare_runs, sample_rng

if _TYPE_CHECKING:
    from ._dataset import BlobDataset, BlobLoader, FolderDataset, Mixture
    from ._sampling import ElasticDistributedSampler, MixtureSampler, PartitionedSampler


def _public(obj: _Any) -> _Any:
    """Name an export by where users find it (``blobdata.X`` in reprs and tracebacks), wherever it lives."""
    obj.__module__ = __name__
    return obj


def __getattr__(name: str) -> object:
    # FolderDataset, BlobLoader and the samplers need torch (seconds to import); the command line and
    # the cache do not.
    if name in ("BlobDataset", "FolderDataset", "BlobLoader", "Mixture"):
        from . import _dataset

        return _public(getattr(_dataset, name))
    if name in ("PartitionedSampler", "ElasticDistributedSampler", "MixtureSampler"):
        from . import _sampling

        return _public(getattr(_sampling, name))
    raise AttributeError(f"module 'blobdata' has no attribute {name!r}")


__version__ = "0.3.0"

__all__ = [
    "AccessDenied",
    "BlobCache",
    "BlobDataset",
    "BlobLoader",
    "BlobdataError",
    "CacheError",
    "CacheStats",
    "ConfigError",
    "DecodeError",
    "ElasticDistributedSampler",
    "EmptyDatasetError",
    "FetchError",
    "FetchOptions",
    "FetchTimeout",
    "FolderDataset",
    "LoaderStats",
    "Manifest",
    "ManifestError",
    "MissingMember",
    "Mixture",
    "MixtureSampler",
    "NotFound",
    "ObjectChanged",
    "PartitionedSampler",
    "Peers",
    "Throttled",
    "WarmSummary",
    "__version__",
    "compare_runs",
    "list_folder",
    "sample_rng",
    "warm",
]

_LAZY = (
    "BlobDataset", "BlobLoader", "ElasticDistributedSampler", "FolderDataset", "Mixture", "MixtureSampler",
    "PartitionedSampler",
)  # fmt: skip
for _name in __all__:
    if _name != "__version__" and _name not in _LAZY:
        _public(globals()[_name])
del _name

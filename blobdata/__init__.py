"""blobdata: train PyTorch models straight from a folder in a bucket.

>>> from blobdata import FolderDataset
>>> ds = FolderDataset("s3://bucket/imagenet/train", transform=t, cache="/mnt/nvme/blobdata")
>>> loader = ds.dataloader(batch_size=256, shuffle=True, num_workers=8)
"""

from ._cache import BlobCache, CacheStats
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
    NotFound,
    ObjectChanged,
    Throttled,
)
from ._listing import load_or_list as list_folder
from ._manifest import Manifest
from ._stats import LoaderStats
from ._warm import warm_cache as warm
from ._warm_summary import WarmSummary

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._dataset import FolderDataset
    from ._loader import BlobLoader
    from ._partition import PartitionedSampler
    from ._resume import ElasticDistributedSampler


def __getattr__(name: str) -> object:
    # FolderDataset, BlobLoader and the samplers need torch (seconds to import); the command line and
    # the cache do not.
    if name == "FolderDataset":
        from ._dataset import FolderDataset

        return FolderDataset
    if name == "BlobLoader":
        from ._loader import BlobLoader

        return BlobLoader
    if name == "PartitionedSampler":
        from ._partition import PartitionedSampler

        return PartitionedSampler
    if name == "ElasticDistributedSampler":
        from ._resume import ElasticDistributedSampler

        return ElasticDistributedSampler
    raise AttributeError(f"module 'blobdata' has no attribute {name!r}")


__version__ = "0.2.0"

__all__ = [
    "AccessDenied",
    "BlobCache",
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
    "NotFound",
    "ObjectChanged",
    "PartitionedSampler",
    "Throttled",
    "WarmSummary",
    "__version__",
    "list_folder",
    "warm",
]

"""blobdata: train PyTorch models straight from a folder in a bucket.

>>> from blobdata import FolderDataset
>>> ds = FolderDataset("s3://bucket/imagenet/train", transform=t, cache_dir="/mnt/nvme/blobdata")
>>> loader = ds.dataloader(batch_size=256, shuffle=True, num_workers=8)
"""

from ._cache import BlobCache, CacheStats
from ._config import FetchOptions
from ._dataset import FolderDataset
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
from ._manifest import Manifest

__version__ = "0.1.0"

__all__ = [
    "AccessDenied",
    "BlobCache",
    "BlobdataError",
    "CacheError",
    "CacheStats",
    "ConfigError",
    "DecodeError",
    "EmptyDatasetError",
    "FetchError",
    "FetchOptions",
    "FetchTimeout",
    "FolderDataset",
    "Manifest",
    "ManifestError",
    "NotFound",
    "ObjectChanged",
    "Throttled",
    "__version__",
]

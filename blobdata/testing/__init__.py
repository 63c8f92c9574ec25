"""Tools for testing a training pipeline without a cloud: local servers, a fault proxy, synthetic data.

>>> from blobdata.testing import LocalS3Server, LatencyProxy, synthetic_dataset, upload, s3_client
>>> with LocalS3Server() as s3, LatencyProxy("127.0.0.1", s3.port, delay_s=0.025) as proxy:
...     s3.create_bucket("data")
...     upload(s3_client(s3), "data", synthetic_dataset(100, 4))
...     proxy.fail_next(2, "status503")    # then read s3://data/train through proxy.endpoint_url

``HostileServer`` is a store that misbehaves on request (wrong ranges, no ETag, a huge
Content-Length, endless bodies and listings, ...); ``HttpProxy`` a CONNECT and forward proxy.

Importing this package starts nothing and does not import torch (``TrainTransform`` does, when it
first runs). Azurite and the GCS emulator need their own installs (``npm install -g azurite``,
``pip install gcp-storage-emulator``).
"""

from .data import TrainTransform, folder_files, synthetic_dataset, synthetic_jpeg, upload
from .emulators import LocalAzurite, LocalGCSEmulator
from .hostile import HOSTILE_MODES, HostileMode, HostileServer
from .http_proxy import HttpProxy
from .proxy import FaultMode, LatencyProxy
from .servers import LocalS3Server, S3Endpoint, create_bucket, find_free_port, s3_client
from .synthetic_list import SyntheticListServer

__all__ = [
    "FaultMode",
    "HOSTILE_MODES",
    "HostileMode",
    "HostileServer",
    "HttpProxy",
    "LatencyProxy",
    "LocalAzurite",
    "LocalGCSEmulator",
    "LocalS3Server",
    "S3Endpoint",
    "SyntheticListServer",
    "TrainTransform",
    "create_bucket",
    "find_free_port",
    "folder_files",
    "s3_client",
    "synthetic_dataset",
    "synthetic_jpeg",
    "upload",
]

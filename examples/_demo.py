"""``--demo`` for the BlobDataset examples: a local S3 server (blobdata's test kit) holding synthetic data.

with demo_bucket({"pairs/0.jpg": b"...", ...}) as (url, storage_options):
    ...  # url is s3://demo/<the common folder>
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image


def image_bytes(seed: int, size: tuple[int, int] = (48, 40), fmt: str = "JPEG", mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(out, fmt)
    return out.getvalue()


@contextlib.contextmanager
def demo_bucket(objects: dict[str, bytes], folder: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A throw-away S3 server whose bucket ``demo`` holds ``objects``; yields ``(url, storage_options)``."""
    from blobdata.testing import LocalS3Server, s3_client, upload

    with LocalS3Server() as server:
        server.create_bucket("demo")
        upload(s3_client(server), "demo", objects.items())
        yield f"s3://demo/{folder}", server.storage_options

"""A loop that breaks out of an epoch (num_workers=0): the look-ahead's requests for the rest of that
epoch are cancelled, not left to run (and retry) for batches nobody will ask for."""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from blobdata import FolderDataset
from tests.conftest import S3Proxy

N = 24


def _nbytes(f: Any) -> int:
    return len(f.read())


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i % 250, dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.timeout(120)
def test_an_abandoned_epoch_cancels_its_look_ahead(s3_bucket: Any, s3_server: Any) -> None:
    s3_bucket.put_many({f"d/c{i % 2}/{i:03d}.jpg": _jpeg(i) for i in range(N)})
    with S3Proxy(s3_server) as proxy:
        opts = proxy.storage_options
        ds = FolderDataset(s3_bucket.url("d"), storage_options=opts, loader=_nbytes, lookahead=16)
        loader = ds.dataloader(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
        proxy.delay_s = 0.25  # listed already: from now on every request takes half a second
        it = iter(loader)
        next(it)  # the first batch; the look-ahead now fetches the next ones
        proc = ds._proc
        assert proc is not None and proc.lookahead is not None
        in_flight = list(proc.lookahead.stager._tasks.values())
        assert in_flight and not any(t.done() for t in in_flight)
        del it  # the loop breaks out of the epoch
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(t.done() for t in in_flight):
            time.sleep(0.02)
        assert all(t.cancelled() for t in in_flight)
        assert len(proc.lookahead.stager) == 0
        proxy.delay_s = 0.0
        # The loader is whole again for the next epoch.
        assert sum(len(batch[1]) for batch in loader) == N

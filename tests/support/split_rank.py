"""One rank of a listing split across a torchrun job (tests/listing/test_split_listing.py and
benchmarks/bench_scale.py run it): lists ``URL`` with the job through the process group (``group``) or
the shared directory (``files``), and writes what it asked the store and the listing it ended with.

    torchrun --nproc-per-node 2 tests/support/split_rank.py group|files URL ENDPOINT OUT_DIR [flat]
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

import numpy as np


def main() -> None:
    mode, url, endpoint, out = sys.argv[1:5]
    flat = len(sys.argv) > 5 and sys.argv[5] == "flat"
    import torch.distributed as dist

    from blobdata._listing import help_list, job, load_or_list, load_or_list_flat, shared_manifest
    from blobdata._stores.s3 import listing as s3_listing

    split = job.split  # white-box: its page packing is wrapped to record the pages

    if mode == "group":
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    asked: list[list[Any]] = []
    request = s3_listing.S3LeanLister._request

    async def counted(
        self: Any, prefix: str, delimiter: Any, token: Any, start_after: Any, timeout: float
    ) -> Any:
        asked.append([prefix, delimiter, token, start_after if token is None else None])
        return await request(self, prefix, delimiter, token, start_after, timeout)

    s3_listing.S3LeanLister._request = counted  # type: ignore[method-assign]
    parts: list[list[Any]] = []
    pack = split._pack

    def recorded(mine: Any) -> bytes:
        parts.extend([folder, [list(r) for r in part.ranges]] for folder, part in mine)
        return pack(mine)

    split._pack = recorded  # type: ignore[assignment]
    opts = {"endpoint_url": endpoint, "key": "synthetic", "secret": "synthetic-secret"}
    t0, c0 = time.perf_counter(), time.process_time()
    if flat:
        make = functools.partial(load_or_list_flat, url, storage_options=opts, refresh=True)
        help = functools.partial(help_list, url, storage_options=opts, fetch_options=None, flat=True)
    else:
        make = functools.partial(load_or_list, url, storage_options=opts, save=False)
        help = functools.partial(help_list, url, storage_options=opts, fetch_options=None)
    manifest = shared_manifest(url, make, key="split-test", help=help)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    arrays = {name: np.asarray(a) for name, a in manifest._arrays().items()}
    np.savez(os.path.join(out, f"manifest{rank}.npz"), classes=np.array(manifest.classes), **arrays)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"requests": asked, "parts": parts, "wall_s": wall, "cpu_s": cpu}, f)
    if mode == "group":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Two torchrun "nodes" on 127.0.0.1, each with its own cache of 60% of the dataset, training with
PartitionedSampler (examples/train_ddp.py --sampler partitioned): after the first epoch, the bucket
is not read again (benchmarks/bench_partition_torchrun.py measures the same at a larger size, next
to DistributedSampler's order)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobdata import BlobCache
from blobdata._sampling import node_share
from blobdata.testing import find_free_port
from tests.conftest import S3Proxy
from tests.listing.test_distributed import _env, _finish, _logs, _torchrun
from tests.support.buckets import TestBucket

pytestmark = [pytest.mark.slow, pytest.mark.network]

N, SIZE = 100, 40_000  # objects of 40 kB: in pack files, so the cache's bound is mostly their bytes


def _gets(proxy: S3Proxy) -> int:
    return sum(1 for m, t in proxy.requests if m == "GET" and "list-type=2" not in t)


@pytest.mark.timeout(300)
def test_two_nodes_read_the_bucket_once_over_three_epochs(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    body = os.urandom(SIZE)
    s3_bucket.put_many({f"train/c{i * 5 // N}/{i:03d}.png": body for i in range(N)})  # sorted by class
    url, env = s3_bucket.url("train"), _env(s3_proxy)
    env["BLOBDATA_CACHE_HOME"] = str(tmp_path / "home")
    limit = str(int(0.6 * N * SIZE))

    def job(epochs: int) -> None:
        port = find_free_port()
        common = ["--sampler", "partitioned", "--epochs", str(epochs), "--batch-size", "5",
                  "--cache-size", limit, "--checkpoint", str(tmp_path / "ckpt"),
                  "--ids-log", str(tmp_path / "log")]  # fmt: skip
        procs = []
        for node in range(2):
            args = [*common, "--cache-dir", str(tmp_path / f"cache{node}")]
            procs.append(_torchrun(url, env, *args, nproc=1, nnodes=2, node=node, port=port))
        for proc in procs:
            _finish(proc)

    job(1)
    first = _gets(s3_proxy)
    s3_proxy.reset_counts()
    job(3)  # resumes after epoch 1 (the checkpoint), epochs 2 and 3 from the node caches
    later = _gets(s3_proxy)
    assert first == N
    assert later <= 0.01 * first  # done-when: epochs 2 and 3 at most 1% of epoch 1's GETs
    logs = _logs(tmp_path / "log")
    for rank, (_, batches) in logs.items():  # rank = node here (1 rank per node)
        share = set(node_share(N, seed=0, nnodes=2, node=rank).tolist())
        per_epoch = {e: {i for ep, ids in batches if ep == e for i in ids} for e in (0, 1, 2)}
        assert all(read == share for read in per_epoch.values())  # the same share, every epoch
        orders = [[i for ep, ids in batches if ep == e for i in ids] for e in (0, 1, 2)]
        assert orders[0] != orders[1] != orders[2]  # shuffled afresh each epoch
        with BlobCache.inspect(tmp_path / f"cache{rank}") as cache:
            assert cache.stats().entries == N // 2 and cache.stats().volume_bytes <= int(limit)

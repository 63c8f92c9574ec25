"""Nodes that serve each other their caches, as real processes on loopback addresses, against a real
S3 server behind a proxy that counts the bucket's GETs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.peers.nodes import Store, log_of, node_spec, run_nodes, upload

pytestmark = pytest.mark.timeout(300)


def _gets(proxy: Any) -> int:
    return sum(1 for m, t in proxy.requests if m == "GET" and "list-type" not in t)


def test_a_global_shuffle_reads_each_object_from_the_bucket_once(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any
) -> None:
    n = 96
    digests = upload(s3_bucket, n)
    store = Store()
    options = {**s3_bucket.storage_options, "endpoint_url": s3_proxy.endpoint_url}
    specs = [
        node_spec(tmp_path, "job1", store, r, 3, url=s3_bucket.url("train"), storage_options=options,
                  epochs=[0, 1, 2])  # fmt: skip
        for r in range(3)
    ]
    results = run_nodes(tmp_path, specs)
    assert all(r is not None for r in results), [log_of(s) for s in specs]
    for epoch in range(3):
        seen = sorted(i for r in results for i, _ in r["epochs"][epoch]["samples"])
        assert seen == list(range(n))
    for r in results:
        for e in r["epochs"]:
            assert all(digests[i] == d for i, d in e["samples"])
    print([[ {k: v for k, v in e["stats"].items() if "peer" in k or "from" in k} for e in r["epochs"]] for r in results])
    print(_gets(s3_proxy))

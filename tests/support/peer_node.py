"""One node of a job with peers, in a process of its own: ``python -m tests.support.peer_node SPEC``.

``SPEC`` is a JSON file (test credentials only)::

    {"url", "storage_options", "store": [host, port], "job", "nnodes", "node_rank", "host",
     "advertise" (optional), "cache", "cache_size", "kind": "folder" | "blob",
     "sampler": "elastic" | "distributed", "world", "epochs": [0, 1], "batch_size", "workers",
     "stop_after" (batches of the last epoch, optional), "state_in", "state_out" (paths, optional),
     "die_after" ([epoch, batches]: SIGKILL itself there, optional), "barrier": nodes that meet between
     epochs (0: none), "final": nodes that meet at the end, "out"}

Each object's bytes begin with its sample number (8 digits), so what the node read is checked by the
test against what it uploaded: ``out`` gets ``{"epochs": [{"epoch", "samples": [[number, sha256], ...],
"stats": {...}}], "state": ...}`` (stats: the loader's, counted over that epoch). Between epochs the
nodes wait for each other in the store, and at the end for all of them, so that each node's service
serves the others until they are done.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any


def raw(fh: Any) -> bytes:
    return bytes(fh.read())


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def _barrier(store: Any, name: str, n: int, timeout: float = 120.0) -> None:
    if n <= 0:
        return
    store.add(name, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(name, 0)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: {store.add(name, 0)} of {n} nodes came")
        time.sleep(0.02)


def _payload(sample: Any) -> bytes:
    if isinstance(sample, dict):  # BlobDataset: the one member
        return bytes(next(v for k, v in sample.items() if not k.startswith("__")))
    return bytes(sample[0])


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from blobdata import BlobCache, BlobDataset, ElasticDistributedSampler, FolderDataset, Peers

    with open(argv[0]) as fh:
        spec = json.load(fh)
    store = dist.TCPStore(spec["store"][0], spec["store"][1], is_master=False)
    peers = Peers(
        store=store, nnodes=spec["nnodes"], node_rank=spec["node_rank"], host=spec["host"],
        advertise=spec.get("advertise"), job=spec["job"], timeout=60,
    )  # fmt: skip
    cache = BlobCache(spec["cache"], size_limit=spec.get("cache_size", "1GB"))
    options = spec["storage_options"]
    if spec.get("kind", "folder") == "blob":
        ds: Any = BlobDataset(spec["url"], decoders=False, storage_options=options, cache=cache, peers=peers)
    else:
        ds = FolderDataset(
            spec["url"], loader=raw, extensions=(".bin",), storage_options=options, cache=cache, peers=peers
        )
    world, rank = spec.get("world", spec["nnodes"]), spec["node_rank"]
    if spec.get("sampler", "elastic") == "distributed":
        from torch.utils.data.distributed import DistributedSampler

        sampler: Any = DistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
    else:
        sampler = ElasticDistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
    loader = ds.dataloader(
        batch_size=spec["batch_size"], sampler=sampler, num_workers=spec["workers"], collate_fn=as_list
    )
    if spec.get("state_in"):
        with open(spec["state_in"]) as fh:
            loader.load_state_dict(json.load(fh))
    out: dict[str, Any] = {"epochs": [], "state": None}
    epochs = spec["epochs"]
    die = spec.get("die_after")
    before = loader.stats().as_dict()
    for epoch in epochs:
        _barrier(store, f"{spec['job']}/epoch/{epoch}", spec.get("barrier", 0))
        sampler.set_epoch(epoch)
        samples = []
        for k, batch in enumerate(loader):
            for sample in batch:
                data = _payload(sample)
                samples.append([int(data[:8]), hashlib.sha256(data).hexdigest()])
            if die is not None and die[0] == epoch and k + 1 == die[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.get("stop_after") and epoch == epochs[-1] and k + 1 == spec["stop_after"]:
                break
        now = loader.stats().as_dict()
        out["epochs"].append(
            {"epoch": epoch, "samples": samples, "stats": {k: now[k] - before[k] for k in now}}
        )
        before = now
    out["state"] = json.loads(json.dumps(loader.state_dict()))
    if spec.get("state_out"):
        with open(spec["state_out"], "w") as fh:
            json.dump(out["state"], fh)
    with open(spec["out"], "w") as fh:
        json.dump(out, fh)
    _barrier(store, f"{spec['job']}/final", spec.get("final", spec["nnodes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

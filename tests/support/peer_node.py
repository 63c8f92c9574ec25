"""One node of a job with peers, in a process of its own: ``python -m tests.support.peer_node SPEC``.

``SPEC`` is a JSON file (test credentials only)::

    {"url", "storage_options", "store": [host, port], "job", "nnodes", "node_rank", "host",
     "port", "advertise" (optional), "cache", "cache_size", "kind": "folder" | "blob" | "mixture",
     "sampler": "elastic" | "distributed", "world", "epochs": [0, 1], "batch_size", "workers",
     "stop_after" (batches of the last epoch, optional), "state_in", "state_out" (paths, optional),
     "die_after" ([epoch, batches]: SIGKILL itself there, optional), "lookahead" (optional), "out"}

Each object's bytes begin with its sample number (8 digits), so what the node read is checked by the
test against what it uploaded: ``out`` gets ``{"epochs": [{"epoch", "samples": [[number, sha256], ...],
"stats": {...}}], "state": ..., "lookahead": ...}`` (stats: the loader's, counted over that epoch; the
dataset's look-ahead). Before each epoch and at the end the node arrives at a meeting point in the
store and waits for the test to let it go on (:func:`tests.support.peer_nodes.run_nodes`), so that each
node's service serves the others until all are done.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any


def raw(fh: Any) -> bytes:
    return bytes(fh.read())


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def _meet(store: Any, job: str, point: str, timeout: float = 200.0) -> None:
    """Arrive at ``point`` and wait for the test to let the nodes go on (it counts the bucket's GETs
    between points)."""
    import datetime

    store.add(f"{job}/arrive/{point}", 1)
    store.wait([f"{job}/go/{point}"], datetime.timedelta(seconds=timeout))


def _payload(sample: Any) -> bytes:
    if isinstance(sample, dict):  # BlobDataset: the one member
        return bytes(next(v for k, v in sample.items() if not k.startswith("__")))
    return bytes(sample[0])


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from blobdata import BlobCache, BlobDataset, ElasticDistributedSampler, FetchOptions, FolderDataset, Peers

    with open(argv[0]) as fh:
        spec = json.load(fh)
    store = dist.TCPStore(spec["store"][0], spec["store"][1], is_master=False)
    peers = Peers(
        store=store, nnodes=spec["nnodes"], node_rank=spec["node_rank"], host=spec["host"],
        port=spec.get("port", 0), advertise=spec.get("advertise"), job=spec["job"], timeout=60,
        service_process=spec.get("service_process", True),
    )  # fmt: skip
    cache = BlobCache(spec["cache"], size_limit=spec.get("cache_size", "1GB"))
    options = spec["storage_options"]
    kind = spec.get("kind", "folder")
    # The look-ahead given, else the default (with peers: blobdata._peers.PEERS_LOOKAHEAD).
    ahead = {"fetch_options": FetchOptions(lookahead=spec["lookahead"])} if "lookahead" in spec else {}
    if kind == "blob":
        ds: Any = BlobDataset(
            spec["url"], decoders=False, storage_options=options, cache=cache, peers=peers, **ahead
        )
    elif kind == "mixture":  # two sources (two class folders), each read once an epoch, one meeting
        from blobdata import Mixture

        a, b = (
            BlobDataset(f"{spec['url']}/{c}", decoders=False, storage_options=options, cache=cache,
                        peers=peers, **ahead)
            for c in ("c0", "c1")
        )  # fmt: skip
        ds = Mixture({"a": a, "b": b}, {"a": len(a), "b": len(b)})
    else:
        ds = FolderDataset(
            spec["url"], loader=raw, extensions=(".bin",), storage_options=options, cache=cache, peers=peers,
            **ahead,
        )
    world, rank = spec.get("world", spec["nnodes"]), spec["node_rank"]
    if kind == "mixture":
        from blobdata import MixtureSampler

        sampler: Any = MixtureSampler(ds, num_replicas=world, rank=rank, seed=7, nproc_per_node=1)
    elif spec.get("sampler", "elastic") == "distributed":
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
    else:
        sampler = ElasticDistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
    loader = ds.dataloader(
        batch_size=spec["batch_size"], sampler=sampler, num_workers=spec["workers"], collate_fn=as_list
    )
    if spec.get("state_in"):
        with open(spec["state_in"]) as fh:
            loader.load_state_dict(json.load(fh))
    out: dict[str, Any] = {"epochs": [], "state": None, "lookahead": ds.lookahead}
    epochs = spec["epochs"]
    die = spec.get("die_after")
    before = loader.stats().as_dict()
    for epoch in epochs:
        _meet(store, spec["job"], str(epoch))
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
        # Near an epoch's end the training process reads the next epoch's first batches for the workers
        # it starts then (what this node's cache does not keep): counted in this epoch once done.
        ds._settle_hand_over(wait_s=60.0)
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
    _meet(store, spec["job"], "end")  # serve the others until they are done
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""DDP training from a bucket folder under torchrun, resumable mid-epoch, at any number of ranks.

    torchrun --nproc-per-node 2 examples/train_ddp.py s3://bucket/train --smoke \
        --cache-dir /mnt/nvme/blobdata --checkpoint /shared/ckpt --epochs 3

The model is a toy (CPU, gloo, a linear layer over each object's first 16 bytes; any folder, such as
``blobdata.testing.synthetic_dataset``'s), as the tests run it; put your model, transform and backend
(NCCL) in its place.

- The listing is made once for the job: rank 0 lists (or loads the remembered listing) and the
  other ranks receive it through the process group.
- Each rank fetches only its share (``ElasticDistributedSampler``, ``DistributedSampler``'s order);
  the ranks of one node share ``--cache-dir``. ``--sampler partitioned`` (``PartitionedSampler``)
  keeps each node on the same share every epoch, so a node's cache of its share serves every epoch.
- Rank 0 checkpoints the model and the loader's state every ``--save-every`` steps; started again
  with the same ``--checkpoint``, the run goes on where it stopped with the same order, even with
  another number of ranks or ``--batch-size`` (the rest of the epoch is dealt to the ranks there are
  and batched at the new size; ``--sampler distributed`` too).

Storage credentials and endpoints come from the environment (``AWS_ENDPOINT_URL_S3``, ...).
With ``--ids-log DIR`` each rank appends the sample ids of each batch to ``DIR/rank<R>.jsonl`` (smoke mode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from blobdata import BlobCache, ElasticDistributedSampler, FolderDataset, PartitionedSampler


class SmokeSample:
    """Smoke mode's loader: the sample's index in ``ds.samples`` (its id in ``--ids-log``) and the
    object's first 16 bytes as features. Object names are free (``n01440764_10026.JPEG`` too)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # path or URL -> sample index, filled once the dataset is listed

    def __call__(self, f: Any) -> tuple[int, torch.Tensor]:
        head = f.read(16).ljust(16, b"\0")
        return self.index[f.name], torch.frombuffer(bytearray(head), dtype=torch.uint8).float() / 255


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--cache-size", help="raise the cache's size bound (default: the stored one)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument(
        "--sampler",
        choices=["elastic", "distributed", "partitioned", "shuffle"],
        default="elastic",
        help="ElasticDistributedSampler (default), DistributedSampler, PartitionedSampler (each node "
        "reads a fixed share every epoch), or shuffle=True (1 rank)",
    )
    p.add_argument("--checkpoint", type=Path, default=None, help="directory: model.pt and loader.json")
    p.add_argument("--save-every", type=int, default=1, help="steps between checkpoints")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, a toy model over raw bytes")
    p.add_argument(
        "--ids-log", type=Path, default=None, help="smoke mode: write each batch's sample ids here"
    )
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds of pretend work per step")
    p.add_argument(
        "--list-before-init", action="store_true", help="make the dataset before the process group"
    )
    args = p.parse_args()
    if not args.smoke:
        raise SystemExit("this example's model is a toy over raw bytes: run it with --smoke, or put yours in")

    backend = "gloo" if args.smoke or not torch.cuda.is_available() else "nccl"
    smoke_sample = SmokeSample()
    cache = BlobCache(args.cache_dir, size_limit=args.cache_size) if args.cache_dir else None
    kw: dict[str, Any] = {"cache": cache, "loader": smoke_sample} if args.smoke else {}
    if args.list_before_init:  # torchrun's variables are enough: rank 0 hands the listing over a file
        ds = FolderDataset(args.url, **{k: v for k, v in kw.items() if v is not None})
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not args.list_before_init:
        ds = FolderDataset(args.url, **{k: v for k, v in kw.items() if v is not None})
    smoke_sample.index = {path: i for i, (path, _) in enumerate(ds.samples)}  # the workers get a copy
    torch.manual_seed(0)
    if args.sampler == "shuffle":
        loader = ds.dataloader(batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    else:
        samplers = {"elastic": ElasticDistributedSampler, "partitioned": PartitionedSampler}
        cls = samplers.get(args.sampler, DistributedSampler)
        loader = ds.dataloader(batch_size=args.batch_size, sampler=cls(ds, seed=0), num_workers=args.workers)

    model: torch.nn.Module = torch.nn.Linear(16, len(ds.classes))  # put your model (and transform) here
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    start_epoch = 0
    ckpt = args.checkpoint
    if ckpt is not None and (ckpt / "loader.json").exists():
        state = json.loads((ckpt / "loader.json").read_text())
        model.load_state_dict(torch.load(ckpt / "model.pt", weights_only=True))
        loader.load_state_dict(state["loader"])
        start_epoch = state["loader"]["epoch"] + (1 if state["loader"]["complete"] else 0)
    if args.ids_log is not None:
        args.ids_log.mkdir(parents=True, exist_ok=True)
        table = hashlib.sha256(ds.manifest.to_bytes()).hexdigest()
        with open(args.ids_log / f"rank{rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"rank": rank, "world": world, "table": table, "pid": os.getpid()}) + "\n")
    step = 0
    for epoch in range(start_epoch, args.epochs):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for (ids, x), y in loader:
            loss = F.cross_entropy(ddp(x), y)  # DDP's all-reduce keeps the ranks in lockstep
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if args.ids_log is not None:
                with open(args.ids_log / f"rank{rank}.jsonl", "a") as fh:
                    fh.write(json.dumps({"epoch": epoch, "ids": ids.tolist()}) + "\n")
                dist.barrier()  # a checkpoint then covers batches every rank has logged
            if ckpt is not None and rank == 0 and step % args.save_every == 0:
                ckpt.mkdir(parents=True, exist_ok=True)
                buf = ckpt / "model.pt.tmp"
                torch.save(model.state_dict(), buf)
                os.replace(buf, ckpt / "model.pt")
                atomic_write(ckpt / "loader.json", json.dumps({"loader": loader.state_dict()}).encode())
            time.sleep(args.step_delay)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A training loop under torchrun (gloo, CPU) that stops mid-epoch and resumes, for
tests/sampling/test_resume_torchrun.py: every rank logs, per batch, the ids of its samples and a digest
of each sample's pixels, made by keyed transforms (blobdata's ``RandomResizedCrop`` and a jitter drawn
from ``blobdata.sample_rng()``).

    torchrun --nproc-per-node N tests/support/resume_app.py ROOT --ids-log DIR --state FILE \
        --batch-size B [--sampler shuffle|distributed] [--workers W] [--epochs E] [--stop-after K]

The ranks step in lockstep (an all-reduce per step, as DDP's); with ``--stop-after K`` they stop after
K steps and rank 0 writes the loader's state to ``--state``; started with an existing ``--state``, the
run loads it and goes on from that epoch. DataLoader workers start by forkserver: a fork while gloo's
threads run can hang a worker on CPython 3.11.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

import blobdata
from blobdata import FolderDataset
from blobdata.transforms import RandomResizedCrop

SEED = 7  # the sampler's seed, and the generator's: the loader seed of the augmentation either way


class Keyed:
    """Decode-aware: the crop draws from (loader seed, epoch, URL), the jitter from ``sample_rng()``;
    the sample's id (its file name) goes with its pixels."""

    def __init__(self, size: int) -> None:
        self.crop = RandomResizedCrop(size)

    def decode_and_apply(self, data: bytes, url: str) -> tuple[torch.Tensor, int]:
        pixels = self.crop.decode_and_apply(data, url).float()
        return pixels * float(blobdata.sample_rng().uniform(0.5, 1.5)), int(Path(url).stem)

    def __call__(self, img: Any) -> Any:  # not used: the dataset hands a decode-aware transform bytes
        raise AssertionError("Keyed is decode-aware")


def digest(pixels: torch.Tensor) -> str:
    return hashlib.blake2b(pixels.contiguous().numpy().tobytes(), digest_size=8).hexdigest()


def make_loader(root: str, *, sampler: str, batch_size: int, workers: int) -> Any:
    from tests.support.resume_app import Keyed  # by its module's name: forkserver workers unpickle it

    ds = FolderDataset(root, transform=Keyed(8), lookahead=8)
    kw: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "forkserver"
    if sampler == "shuffle":
        return ds.dataloader(shuffle=True, generator=torch.Generator().manual_seed(SEED), **kw)
    return ds.dataloader(sampler=DistributedSampler(ds, seed=SEED), **kw)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--ids-log", type=Path, required=True)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--sampler", choices=["shuffle", "distributed"], default="distributed")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-after", type=int, default=0)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = make_loader(args.root, sampler=args.sampler, batch_size=args.batch_size, workers=args.workers)
    start = 0
    if args.state.exists():
        state = json.loads(args.state.read_text())
        loader.load_state_dict(state)
        start = state["epoch"] + int(state["complete"])
    args.ids_log.mkdir(parents=True, exist_ok=True)
    log = args.ids_log / f"rank{rank}.jsonl"
    step = 0
    for epoch in range(start, args.epochs):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        for (pixels, ids), _ in loader:
            record = {"epoch": epoch, "ids": ids.tolist(), "px": [digest(x) for x in pixels]}
            with open(log, "a") as fh:
                fh.write(json.dumps(record) + "\n")
            dist.all_reduce(torch.zeros(1))  # the ranks in lockstep, as DDP's gradients keep them
            step += 1
            if step == args.stop_after:
                break
        if step == args.stop_after:
            if rank == 0:
                tmp = args.state.with_suffix(".tmp")
                tmp.write_text(json.dumps(loader.state_dict()))
                os.replace(tmp, args.state)
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a ResNet on an ImageNet-style folder in a bucket, on one GPU or with DDP (torchrun).

    python examples/train_resnet.py s3://bucket/imagenet/train --cache-dir /mnt/nvme/blobdata --epochs 90
    python examples/train_resnet.py s3://demo/train --model small --steps 30 --workers 2   # a quick try
    torchrun --nproc-per-node 8 examples/train_resnet.py s3://bucket/imagenet/train \
        --cache-dir /mnt/nvme/blobdata --decode gpu

``--model auto`` (the default) uses torchvision's ResNet-50 when torchvision is installed, otherwise a
small residual network (``--model small``), so the script also runs on a CPU-only box without
torchvision. Every ``--log-every`` steps it prints images/s and the data wait (the share of the time
the loop waited for a batch: near 0% the input pipeline keeps up), and after each epoch the loader's
``stats().summary()``. ``--steps`` and ``--limit`` make a short run; ``python examples/train_resnet.py
--help`` lists every option. ``--decode`` says where JPEGs are decoded:

- ``cpu`` (default): in the DataLoader workers, with ``blobdata.transforms.RandomResizedCrop`` (decode,
  random-resized crop, flip; ~20% less CPU than Pillow's decode followed by torchvision's crop);
  the training loop normalises on the GPU.
- ``gpu``: the workers only fetch bytes; the training process decodes each batch on the GPU (the
  hardware JPEG decoder through nvImageCodec, or nvJPEG; ``pip install 'blobdata[gpu]'``) and
  ``blobdata.gpu.TrainTransform`` crops, flips and normalises it, one batch ahead of the model. On a
  machine without CUDA the same path runs on the CPU (slowly: it is there to be tried anywhere).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from blobdata import BlobCache, FolderDataset, gpu
from blobdata.transforms import RandomResizedCrop

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _small(num_classes: int) -> nn.Module:
    """A small residual network: trains on a CPU in seconds, needs no torchvision."""

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
            )

        def forward(self, x):
            return torch.relu(x + self.body(x))

    return nn.Sequential(
        nn.Conv2d(3, 32, 7, stride=4, padding=3),
        nn.ReLU(),
        Block(32),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        Block(64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, num_classes),
    )


def build(name: str, num_classes: int) -> nn.Module:
    """``small``, or a torchvision ResNet (``resnet18``, ``resnet50``); ``auto``: ResNet-50 where
    torchvision is installed, else ``small``."""
    if name == "small":
        return _small(num_classes)
    try:
        import torchvision
    except ImportError:
        if name == "auto":
            return _small(num_classes)
        raise SystemExit(
            f"--model {name} needs torchvision (pip install torchvision), or use --model small"
        ) from None
    return getattr(torchvision.models, "resnet50" if name == "auto" else name)(num_classes=num_classes)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a ResNet on an ImageNet-style folder (URL/<class>/<image>) read through blobdata.",
    )
    p.add_argument("url", help="the folder: s3://bucket/prefix, gs://..., az://..., or a local path")
    p.add_argument("--cache-dir", help="a local cache directory (an SSD); none: every epoch reads the bucket")
    p.add_argument(
        "--cache-size",
        default=None,
        help="the cache's size bound, e.g. 100GB (default: the cache's own, as it was left)",
    )
    p.add_argument(
        "--model",
        choices=["auto", "small", "resnet18", "resnet50"],
        default="auto",
        help="small: a tiny residual net (CPU-friendly); resnet18/50 need torchvision; "
        "auto (default): resnet50 with torchvision, else small",
    )
    p.add_argument(
        "--epochs", type=int, default=None, help="epochs to train (default 1, or as many as --steps needs)"
    )
    p.add_argument(
        "--steps", type=int, default=None, help="stop after this many steps in all, per rank (default: none)"
    )
    p.add_argument(
        "--limit", type=int, default=None, help="train on a fixed random subset of this many images"
    )
    p.add_argument("--batch-size", type=int, default=256, help="images per step, per rank (default 256)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="DataLoader workers (default: the cores, at most 8)",
    )
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="print images/s and the data wait every this many steps (default 10)",
    )
    p.add_argument("--endpoint-url", default=None, help="an S3-compatible endpoint (MinIO, blobdata serve)")
    p.add_argument(
        "--decode",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where JPEGs are decoded: cpu (in the workers, default) or gpu",
    )
    return p.parse_args()


def main() -> None:
    args = _args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )

    # A cache directory alone opens the cache with its own size bound; --cache-size sets one.
    cache = (
        BlobCache(args.cache_dir, size_limit=args.cache_size)
        if args.cache_dir and args.cache_size
        else args.cache_dir
    )
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    ds = FolderDataset(args.url, cache=cache, storage_options=options)
    if args.limit is not None and args.limit < len(ds):  # the same subset on every rank (seeded)
        keep = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0))[: args.limit].sort().values
        ds.samples = [ds.samples[i] for i in keep.tolist()]
    model = build(args.model, len(ds.classes)).to(device).to(memory_format=torch.channels_last)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    sampler = torch.utils.data.DistributedSampler(ds) if distributed else None
    if args.decode == "gpu":  # batches arrive on `device`, decoded, cropped and normalised
        on_device = {"device": device, "gpu_transform": gpu.TrainTransform(224, mean=MEAN, std=STD)}
    else:  # batches of uint8 crops from the workers; normalised below
        ds.transform, on_device = RandomResizedCrop(224), {"pin_memory": device.type == "cuda"}
    loader = ds.dataloader(
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        drop_last=len(ds) >= args.batch_size * (dist.get_world_size() if distributed else 1),
        **on_device,
    )
    if rank == 0:
        print(f"{args.url}: {len(ds)} images in {len(ds.classes)} classes; {len(loader)} steps per epoch, "
              f"model {args.model}, on {device}", flush=True)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    step = 0
    epochs = args.epochs if args.epochs is not None else (1 if args.steps is None else sys.maxsize)
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        t0, seen, loss = time.perf_counter(), 0, None
        window_t, window_n, window_wait = t0, 0, 0.0  # since the last progress line
        batches = iter(loader)
        while args.steps is None or step < args.steps:
            t_wait = time.perf_counter()
            try:
                images, targets = next(batches)
            except StopIteration:
                break
            window_wait += time.perf_counter() - t_wait  # the data wait: the loop had no batch
            if args.decode == "cpu":
                images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
            loss = nn.functional.cross_entropy(
                model(images.contiguous(memory_format=torch.channels_last)),
                targets.to(device, non_blocking=True),
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(targets)
            window_n += len(targets)
            step += 1
            if rank == 0 and step % args.log_every == 0:
                now = time.perf_counter()
                dt = now - window_t
                print(f"epoch {epoch} step {step}: {window_n / dt:.0f} images/s, data wait "
                      f"{window_wait / dt:.0%} ({window_wait * 1e3 / args.log_every:.0f} ms/step), "
                      f"loss {float(loss.detach()):.3f}", flush=True)  # fmt: skip
                window_t, window_n, window_wait = now, 0, 0.0
        if rank == 0:
            rate = seen / (time.perf_counter() - t0)
            last = f"{float(loss.detach()):.3f}" if loss is not None else "n/a (no batch)"
            print(f"epoch {epoch}: {seen} images, {rate:.0f} images/s per rank, loss {last}", flush=True)
            print(f"  data so far: {loader.stats().summary()}", flush=True)
        if args.steps is not None and step >= args.steps:
            break
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

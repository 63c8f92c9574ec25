"""Train a ResNet on an ImageNet-style folder in a bucket, on one GPU or with DDP (torchrun).

    python examples/train_resnet.py s3://bucket/imagenet/train --cache-dir /mnt/nvme/blobdata --epochs 90
    torchrun --nproc-per-node 8 examples/train_resnet.py s3://bucket/imagenet/train \
        --cache-dir /mnt/nvme/blobdata

Uses torchvision's ResNet-50 and transforms when torchvision is installed, otherwise a small residual
network and blobdata's own transform, so the script also runs on a CPU-only box without torchvision.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from blobdata import BlobCache, FolderDataset


def build(num_classes: int):
    try:
        import torchvision
        from torchvision.transforms import v2

        model = torchvision.models.resnet50(num_classes=num_classes)
        transform = v2.Compose(
            [v2.PILToTensor(), v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]
        )
        return model, transform
    except ImportError:
        from blobdata.testing import TrainTransform

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

        model = nn.Sequential(
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
        return model, TrainTransform(224)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--cache-dir")
    p.add_argument("--cache-size", default="100GB")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--endpoint-url", default=None, help="an S3-compatible endpoint (MinIO, the demo server)")
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    )

    cache = BlobCache(args.cache_dir, size_limit=args.cache_size) if args.cache_dir else None
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    ds = FolderDataset(args.url, cache=cache, storage_options=options)
    model, ds.transform = build(len(ds.classes))
    model = model.to(device).to(memory_format=torch.channels_last)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    sampler = torch.utils.data.DistributedSampler(ds) if distributed else None
    loader = ds.dataloader(
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        persistent_workers=args.workers > 0,
        drop_last=len(ds) >= args.batch_size * (dist.get_world_size() if distributed else 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        t0, seen, loss = time.perf_counter(), 0, None
        for images, targets in loader:
            images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
            loss = nn.functional.cross_entropy(
                model(images.contiguous(memory_format=torch.channels_last)),
                targets.to(device, non_blocking=True),
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(targets)
        if rank == 0:
            rate = seen / (time.perf_counter() - t0)
            last = f"{float(loss.detach()):.3f}" if loss is not None else "n/a (no batch)"
            print(f"epoch {epoch}: {seen} images, {rate:.0f} images/s per rank, loss {last}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Quick start: train from a bucket folder with blobdata.

    python examples/quickstart.py s3://bucket/imagenet/train --cache-dir /mnt/nvme/blobdata

Credentials and endpoints come from the usual places (AWS_* variables, ~/.aws, STORAGE_EMULATOR_HOST,
AZURE_STORAGE_CONNECTION_STRING) or from --endpoint-url. Any callable works as a transform; torchvision's
are used when torchvision is installed.
"""

from __future__ import annotations

import argparse
import time

from blobdata import BlobCache, FolderDataset


def make_transform():
    try:
        from torchvision.transforms import v2

        return v2.Compose(
            [v2.PILToTensor(), v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]
        )
    except ImportError:  # torchvision is optional
        from blobdata.testing import TrainTransform

        return TrainTransform(224)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--cache-size")
    parser.add_argument("--endpoint-url", default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    ds = FolderDataset(
        args.url,
        transform=make_transform(),
        storage_options=options,
        cache=BlobCache(args.cache_dir, size_limit=args.cache_size) if args.cache_dir else None,
    )
    print(ds)
    # A standard DataLoader; dataloader() only lets blobdata see the order so it can fetch ahead.
    loader = ds.dataloader(
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    for epoch in range(args.epochs):
        t0, seen = time.perf_counter(), 0
        for _images, targets in loader:
            seen += len(targets)  # your training step goes here
        print(f"epoch {epoch}: {seen / (time.perf_counter() - t0):.0f} images/s")


if __name__ == "__main__":
    main()

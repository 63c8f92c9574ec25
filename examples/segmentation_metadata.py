"""Segmentation with a metadata file (Hugging Face's imagefolder convention): images and masks in
separate folders, paired by ``metadata.jsonl`` rows ``{"file_name": "images/x.jpg", "mask_file_name":
"masks/x.png", "split": "train"}``.

    python examples/segmentation_metadata.py s3://bucket/seg --cache-dir /mnt/nvme/blobdata
    python examples/segmentation_metadata.py --demo

Each sample is ``{"__key__": "images/x", "jpg": PIL.Image, "mask": PIL.Image, "split": "train", ...}``:
the main object's member is named by its extension, each ``<name>_file_name`` column gives member
``<name>``, and every other column is a field. Nothing is listed that the metadata file does not name.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from blobdata import BlobDataset


def to_tensors(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    image = torch.from_numpy(np.asarray(sample["jpg"]).copy()).permute(2, 0, 1)
    mask = torch.from_numpy(np.asarray(sample["mask"].convert("L")).copy()).long() % 4  # 4 classes
    return image, mask


def run(url: str, storage_options: dict[str, Any] | None, cache_dir: str | None) -> None:
    ds = BlobDataset(url, transform=to_tensors, storage_options=storage_options, cache=cache_dir)
    print(f"{len(ds)} image/mask pairs in {url} (from {url}/metadata.jsonl)")
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2)
    pixels = torch.zeros(4, dtype=torch.long)
    n = 0
    for images, masks in loader:
        n += len(images)
        pixels += torch.bincount(masks.flatten(), minlength=4)
    print(f"{n} samples, images {tuple(images.shape[1:])}, masks {tuple(masks.shape[1:])}, "
          f"class pixels {pixels.tolist()}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url", nargs="?")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--demo", action="store_true", help="start a local S3 server with synthetic data")
    args = p.parse_args()
    if not args.demo:
        if not args.url:
            p.error("give a URL, or --demo")
        run(args.url, None, args.cache_dir)
        return
    from _demo import demo_bucket, image_bytes

    objects: dict[str, bytes] = {}
    rows = []
    for i in range(16):
        objects[f"seg/images/{i:03d}.jpg"] = image_bytes(i, (32, 24))
        objects[f"seg/masks/{i:03d}.png"] = image_bytes(100 + i, (32, 24), "PNG", "L")
        rows.append(
            {"file_name": f"images/{i:03d}.jpg", "mask_file_name": f"masks/{i:03d}.png", "split": "train"}
        )
    objects["seg/metadata.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
    with demo_bucket(objects, "seg") as (url, opts):
        run(url, opts, args.cache_dir)


if __name__ == "__main__":
    main()

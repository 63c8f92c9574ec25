"""COCO-style detection through an index: a flat folder of images plus one annotations JSON, read without
listing the bucket.

    python examples/detection_coco_index.py s3://bucket/coco/train2017 \
        --annotations instances_train2017.json --cache-dir /mnt/nvme/blobdata
    python examples/detection_coco_index.py --demo

The annotations file already names every image (``images[].file_name``), so it is turned once into an
index (one JSON line per image: ``key``, and the image's ``boxes`` and ``labels`` as fields) and the
dataset is built from it: not one LIST request, and the boxes arrive with each sample.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from blobdata import BlobDataset


def coco_index(annotations: dict[str, Any], path: str) -> str:
    """Write a BlobDataset index (JSON Lines) of a COCO annotations dict; returns ``path``."""
    boxes: dict[int, list[list[float]]] = defaultdict(list)
    labels: dict[int, list[int]] = defaultdict(list)
    for a in annotations["annotations"]:
        boxes[a["image_id"]].append(a["bbox"])
        labels[a["image_id"]].append(a["category_id"])
    with open(path, "w") as fh:
        for image in annotations["images"]:
            i = image["id"]
            fh.write(
                json.dumps({"key": image["file_name"], "image_id": i, "boxes": boxes[i], "labels": labels[i]})
            )
            fh.write("\n")
    return path


def to_target(sample: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    image = torch.from_numpy(np.asarray(sample["jpg"]).copy()).permute(2, 0, 1)
    xywh = torch.tensor(sample["boxes"], dtype=torch.float32).reshape(-1, 4)
    boxes = torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], dim=1)  # COCO's xywh to xyxy
    return image, {"boxes": boxes, "labels": torch.tensor(sample["labels"], dtype=torch.int64)}


def as_lists(batch: list[Any]) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    return [b[0] for b in batch], [b[1] for b in batch]


def run(
    url: str, annotations: dict[str, Any], storage_options: dict[str, Any] | None, cache_dir: str | None
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        index = coco_index(annotations, os.path.join(tmp, "index.jsonl"))
        ds = BlobDataset(
            url, index=index, transform=to_target, storage_options=storage_options, cache=cache_dir
        )
    print(f"{len(ds)} images in {url}, from the annotations (no listing)")
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, collate_fn=as_lists)
    images = boxes = 0
    for batch_images, targets in loader:
        images += len(batch_images)
        boxes += sum(len(t["boxes"]) for t in targets)
    print(f"{images} images, {boxes} boxes; {loader.stats().gets} GETs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url", nargs="?")
    p.add_argument("--annotations", help="a COCO annotations JSON (local path)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--demo", action="store_true", help="start a local S3 server with synthetic data")
    args = p.parse_args()
    if not args.demo:
        if not args.url or not args.annotations:
            p.error("give a URL and --annotations, or --demo")
        with open(args.annotations) as fh:
            run(args.url, json.load(fh), None, args.cache_dir)
        return
    from _demo import demo_bucket, image_bytes

    objects = {f"coco/train/{i:012d}.jpg": image_bytes(i, (64, 48)) for i in range(20)}
    annotations = {
        "images": [{"id": i, "file_name": f"{i:012d}.jpg", "width": 64, "height": 48} for i in range(20)],
        "annotations": [
            {"id": k, "image_id": k % 20, "bbox": [1.0, 2.0, 10.0 + k, 8.0], "category_id": 1 + k % 3}
            for k in range(50)
        ],
        "categories": [{"id": c, "name": n} for c, n in ((1, "cat"), (2, "dog"), (3, "bird"))],
    }
    with demo_bucket(objects, "coco/train") as (url, opts):
        run(url, annotations, opts, args.cache_dir)


if __name__ == "__main__":
    main()

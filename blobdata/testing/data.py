"""A synthetic ImageNet-like dataset and the per-sample transform the demo and the benchmarks share.

``synthetic_dataset`` yields photo-like JPEGs under ``train/nXXXXXXXX/``, deterministic for a seed;
``folder_files`` names the files of a folder of one's own; ``upload`` puts either in an S3 bucket (a
bounded number in memory at once); ``TrainTransform`` is the usual training transform
(random-resized-crop, flip, uint8 tensor) written with Pillow and torch only. torch is imported
when the transform first runs, not with this module.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import os
import random
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

__all__ = ["TrainTransform", "folder_files", "synthetic_dataset", "synthetic_jpeg", "upload"]


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
        import torch  # late: importing blobdata.testing must not cost a torch import

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


def folder_files(directory: str | os.PathLike[str], prefix: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``(key, path)`` of every regular file below ``directory`` (symbolic links to files read through,
    links to folders not followed), keyed ``prefix/<path relative to directory>`` with ``/`` separators,
    sorted; and the paths left out because their names are not UTF-8 (an S3 key is)."""
    root = os.fspath(directory)
    found: list[tuple[str, str]] = []
    left: list[str] = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            if not os.path.isfile(path):  # a socket, a fifo, a dangling link
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                left.append(path)
                continue
            found.append((f"{prefix}/{rel}" if prefix else rel, path))
    return found, left


Body = bytes | os.PathLike[str] | str


def upload(client: Any, bucket: str, objects: Iterable[tuple[str, Body]], *, threads: int = 16) -> int:
    """Upload ``(key, bytes)`` pairs, or ``(key, path)`` of files read as they are sent, with a botocore S3
    client, ``threads`` at a time and at most ``4 * threads`` objects in memory; returns how many were
    uploaded (sum the lengths yourself for the bytes)."""
    count = 0

    def put(item: tuple[str, Body]) -> None:
        key, body = item
        if not isinstance(body, bytes):
            with open(body, "rb") as fh:
                body = fh.read()
        client.put_object(Bucket=bucket, Key=key, Body=body)

    with ThreadPoolExecutor(threads) as pool:
        pending: set[concurrent.futures.Future[None]] = set()
        for item in objects:
            pending.add(pool.submit(put, item))
            if len(pending) >= 4 * threads:
                done, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                for f in done:
                    f.result()
                    count += 1
        for f in concurrent.futures.as_completed(pending):
            f.result()
            count += 1
    return count

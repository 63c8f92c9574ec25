"""A realistic mix of JPEGs for the GPU benchmarks, generated in parallel (one process per core).

Most are ImageNet-like photos (300-600 px a side, baseline, 4:2:0); the rest are what a real folder
also holds: progressive, 4:4:4, grayscale, CMYK, EXIF-rotated JPEGs and 1-4 megapixel photos, and
a PNG now and then. Each image depends only on (seed, index), so a run regenerates the same set.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: (kind, share of the images).
MIX = [
    ("baseline 4:2:0", 0.56),
    ("progressive", 0.10),
    ("4:4:4", 0.08),
    ("grayscale", 0.05),
    ("CMYK", 0.02),
    ("EXIF-rotated", 0.06),
    ("1-4 MP photo", 0.12),
    ("PNG", 0.01),
]


def kind_of(index: int, seed: int) -> str:
    u = np.random.default_rng([seed, index, 1]).random()
    acc = 0.0
    for kind, share in MIX:
        acc += share
        if u < acc:
            return kind
    return MIX[0][0]


def image(index: int, seed: int = 0) -> tuple[str, bytes]:
    """(kind, encoded bytes) of image ``index``: a smooth colour field plus grain, photo-like to a codec."""
    kind = kind_of(index, seed)
    rng = np.random.default_rng([seed, index, 2])
    if kind == "1-4 MP photo":
        mp = rng.uniform(1.0, 4.0) * 1e6
        aspect = rng.choice([4 / 3, 3 / 2, 16 / 9, 3 / 4])
        w, h = int((mp * aspect) ** 0.5), int((mp / aspect) ** 0.5)
    else:
        w, h = (int(x) for x in rng.integers(300, 601, 2))
    base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.normal(0.0, 17.0, field.shape).astype(np.int16)
    img = Image.fromarray(np.clip(field + grain, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    save: dict[str, Any] = {"quality": int(rng.integers(80, 95))}
    if kind == "PNG":
        img.save(buf, "PNG", compress_level=1)
        return kind, buf.getvalue()
    if kind == "progressive":
        save["progressive"] = True
    elif kind == "4:4:4":
        save["subsampling"] = 0
    elif kind == "grayscale":
        img = img.convert("L")
    elif kind == "CMYK":
        img = img.convert("CMYK")
    elif kind == "EXIF-rotated":
        exif = Image.Exif()
        exif[0x0112] = int(rng.choice([3, 6, 8]))
        save["exif"] = exif.tobytes()
    img.save(buf, "JPEG", **save)
    return kind, buf.getvalue()


def _one(args: tuple[int, int]) -> tuple[str, bytes]:
    return image(*args)


def generate(n: int, *, seed: int = 0, processes: int | None = None) -> list[tuple[str, bytes]]:
    """``n`` images of the mix, made in parallel."""
    procs = processes or os.cpu_count() or 1
    if procs <= 1 or n < 8:
        return [image(i, seed) for i in range(n)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        return pool.map(_one, [(i, seed) for i in range(n)], chunksize=max(1, n // (procs * 8)))


def folder(root: Path, n: int, *, classes: int = 100, seed: int = 0, log: Any = print) -> dict[str, Any]:
    """The mix as an ImageFolder tree under ``root`` (reused if complete); its keys, kinds and timings."""
    index = root / "index.json"
    if index.exists():
        return dict(json.loads(index.read_text()))
    if root.exists():
        shutil.rmtree(root)
    t0 = time.perf_counter()
    images = generate(n, seed=seed)
    seconds = time.perf_counter() - t0
    keys = []
    for i, (kind, data) in enumerate(images):
        ext = "png" if kind == "PNG" else "jpg"
        key = f"train/c{i % classes:03d}/{i:06d}.{ext}"
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        keys.append(key)
    meta = {
        "keys": keys,
        "classes": sorted({k.split("/")[1] for k in keys}),
        "kinds": dict(Counter(kind for kind, _ in images)),
        "bytes": sum(len(d) for _, d in images),
        "generate_s": seconds,
        "processes": os.cpu_count(),
    }
    tmp = index.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, index)
    log(f"generated {n} images ({meta['bytes'] / 1e6:.0f} MB) in {seconds:.1f}s on {os.cpu_count()} cores")
    return meta

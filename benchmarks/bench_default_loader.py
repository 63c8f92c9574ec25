"""The default loader's decode next to a plain Pillow decode of the same bytes (issue 29), in one run.

    python benchmarks/bench_default_loader.py [--images 40] [--side 640] [--rounds 7] [--progressive]

For each synthetic photo-like JPEG (``blobdata.testing.synthetic_jpeg`` at ``--side`` px square: about
170 KB at 640) it times, per image, in CPU time of this process (one thread):

- ``pillow``: ``PIL.Image.open(io.BytesIO(b)).convert("RGB")``, the floor;
- ``default``: what a dataset does with the bytes of a bucket object and no ``loader=``:
  ``blobdata._decode.decode(b, url, default_loader)`` (the JPEG marker walk included);
- ``walk``: the JPEG marker walk alone as the default loader runs it (``blobdata._decode.walk_jpeg``
  with ``libjpeg=True``: a baseline JPEG's walk stops at its one scan), and ``walk-all`` as the device
  path's guard runs it (every marker, the entropy-coded data searched for the next one), when this
  checkout has it;
- ``path``: a user loader that asks for a path (``Image.open(open(f, "rb"))``): the temporary copy's
  price, for reference.

The variants take turns image by image (each going first in turn), ``--rounds`` times over the images,
and each one's best round is kept, so that a noisy shared machine slows each alike; the ratios to
``pillow`` are what to read.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from blobdata._decode import decode, default_loader
from blobdata.testing import synthetic_jpeg

try:  # the shared JPEG marker walk (issue 29); absent from older checkouts
    from blobdata._decode import walk_jpeg as jpeg_walk
except ImportError:  # pragma: no cover - a baseline checkout
    jpeg_walk = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=40)
    p.add_argument("--side", type=int, default=640)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progressive", action="store_true", help="re-encode the JPEGs as progressive ones")
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    datas = [synthetic_jpeg(rng, min_side=args.side, max_side=args.side) for _ in range(args.images)]
    if args.progressive:
        datas = [_progressive(d) for d in datas]
    urls = [f"s3://bench/train/n0/{i}.JPEG" for i in range(len(datas))]

    def pillow(data: bytes, url: str) -> Any:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")

    def default(data: bytes, url: str) -> Any:
        return decode(data, url, default_loader)

    def by_path(data: bytes, url: str) -> Any:
        def loader(f: Any) -> Any:
            with open(f, "rb") as fh, Image.open(fh) as img:
                return img.convert("RGB")

        return decode(data, url, loader)

    variants: dict[str, Callable[[bytes, str], Any]] = {"pillow": pillow, "default": default}
    if jpeg_walk is not None:
        variants["walk"] = lambda data, url: jpeg_walk(data, libjpeg=True)
        variants["walk-all"] = lambda data, url: jpeg_walk(data)
    variants["path"] = by_path
    names = list(variants)
    best = dict.fromkeys(names, float("inf"))
    for _ in range(args.rounds):
        spent = dict.fromkeys(names, 0.0)
        for k, (data, url) in enumerate(zip(datas, urls, strict=True)):
            for name in names[k % len(names) :] + names[: k % len(names)]:  # each goes first in turn
                fn = variants[name]
                t0 = time.process_time()
                fn(data, url)
                spent[name] += time.process_time() - t0
        for name in names:
            best[name] = min(best[name], spent[name] / len(datas))
    kb = np.mean([len(d) for d in datas]) / 1e3
    kind = "progressive" if args.progressive else "baseline"
    print(f"{len(datas)} {kind} JPEGs, {args.side}x{args.side} px, {kb:.0f} KB on average; CPU time per "
          f"image, best of {args.rounds} rounds (variants in turns, image by image):")  # fmt: skip
    base = best["pillow"]
    for name, s in best.items():
        print(f"  {name:8s} {s * 1e3:7.3f} ms  {s / base:5.3f}x plain Pillow")
    print(f"default loader / plain Pillow: {best['default'] / base:.3f}")


def _progressive(data: bytes) -> bytes:
    out = io.BytesIO()
    with Image.open(io.BytesIO(data)) as img:
        img.save(out, format="JPEG", quality=88, progressive=True)
    return out.getvalue()


if __name__ == "__main__":
    main()

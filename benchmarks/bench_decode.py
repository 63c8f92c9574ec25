"""Reduced-scale JPEG decode for the random-resized crop, next to a full decode (issue 15, CPU path).

    python benchmarks/bench_decode.py [--images 200] [--size 224] [--repeat 3]

For each synthetic ImageNet-like JPEG (``blobdata.testing.synthetic_jpeg``, 300-600 px a side, like
ImageNet's ~500x375) one crop box is drawn, then both paths of ``blobdata.transforms.RandomResizedCrop``
produce the same crop: (a) a full Pillow decode, then crop + torch's antialiased bilinear resize; (b)
its reduced-scale decode (libjpeg DCT scaling) of the same box. Prints the CPU time per image of each
(best of ``--repeat``, process CPU time, one thread), the ratio, and the mean absolute pixel
difference between the two outputs (0-255 scale) with its 99th percentile over images. A first line
times the usual ImageFolder pipeline for the same boxes (``default_loader``'s decode and
``convert("RGB")``, then torchvision's PIL steps: crop, bilinear resize, ``PILToTensor``).
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import torch
from PIL import Image

from blobdata.testing import synthetic_jpeg
from blobdata.transforms import RandomResizedCrop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-side", type=int, default=300)
    p.add_argument("--max-side", type=int, default=600)
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    datas = [
        synthetic_jpeg(rng, min_side=args.min_side, max_side=args.max_side) for _ in range(args.images)
    ]
    crop = RandomResizedCrop(args.size, flip=0.0, generator=torch.Generator().manual_seed(args.seed))
    boxes = []
    for data in datas:
        with Image.open(io.BytesIO(data)) as img:
            boxes.append(crop.params(*img.size))

    def run(reduced: bool) -> tuple[float, list[torch.Tensor]]:
        best, outs = float("inf"), []
        for _ in range(args.repeat):
            outs = []
            t0 = time.process_time()
            for data, box in zip(datas, boxes, strict=True):
                with Image.open(io.BytesIO(data)) as img:
                    outs.append(crop.crop(img, box, reduced=reduced))
            best = min(best, (time.process_time() - t0) / len(datas))
        return best, outs

    def usual() -> tuple[float, list[torch.Tensor]]:
        """What an ImageFolder pipeline does today: ``default_loader`` (decode, ``convert("RGB")``), then
        torchvision's PIL path for the same box: ``crop``, ``resize`` (bilinear), ``PILToTensor``."""
        best, outs = float("inf"), []
        out_h, out_w = crop.size
        for _ in range(args.repeat):
            outs = []
            t0 = time.process_time()
            for data, (top, left, h, w) in zip(datas, boxes, strict=True):
                with Image.open(io.BytesIO(data)) as img:
                    rgb = img.convert("RGB")
                cropped = rgb.crop((left, top, left + w, top + h))
                small = cropped.resize((out_w, out_h), Image.Resampling.BILINEAR)
                outs.append(torch.as_tensor(np.array(small, copy=True)).permute(2, 0, 1))
            best = min(best, (time.process_time() - t0) / len(datas))
        return best, outs

    def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
        diffs = np.array([(x.float() - y.float()).abs().mean().item() for x, y in zip(a, b, strict=True)])
        return f"mean abs difference {diffs.mean():.2f}/255 (p99 over images {np.percentile(diffs, 99):.2f})"

    sides = [f"{w}x{h}" for w, h in (Image.open(io.BytesIO(d)).size for d in datas[:3])]
    print(f"{args.images} JPEGs ({args.min_side}-{args.max_side} px a side, e.g. {', '.join(sides)}), "
          f"crop to {args.size}; CPU time per image, best of {args.repeat}, 1 thread:")  # fmt: skip
    usual_s, usual_out = usual()
    print(f"  the usual path (default_loader, then crop, resize, PILToTensor) {usual_s * 1e3:6.2f} ms")
    full_s, full = run(False)
    print(f"  RandomResizedCrop, full decode (torch's resize) {full_s * 1e3:6.2f} ms  "
          f"{full_s / usual_s:5.2f}x the usual path ({(1 - full_s / usual_s) * 100:3.0f}% cheaper), "
          f"against it: {differences(usual_out, full)}")  # fmt: skip
    for upsample in (1.0, 2.0):
        crop.upsample = upsample
        reduced_s, reduced = run(True)
        opened = (Image.open(io.BytesIO(d)) for d in datas)
        smaller = [crop._reduce(img, b)[0] < 1 for img, b in zip(opened, boxes, strict=True)]
        share = float(np.mean(smaller))
        print(f"  reduced-scale decode, upsample={upsample:.0f}:          {reduced_s * 1e3:6.2f} ms  "
              f"{reduced_s / full_s:5.2f}x ({(1 - reduced_s / full_s) * 100:3.0f}% cheaper), "
              f"{share * 100:3.0f}% of crops decoded smaller, "
              f"against the full decode: {differences(full, reduced)}; "
              f"{reduced_s / usual_s:5.2f}x the usual path "
              f"({(1 - reduced_s / usual_s) * 100:3.0f}% cheaper)")  # fmt: skip


if __name__ == "__main__":
    main()

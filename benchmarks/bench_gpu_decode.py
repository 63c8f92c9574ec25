"""The GPU path's two stages alone, without a model or a bucket: batched decode and TrainTransform (#15).

    python benchmarks/bench_gpu_decode.py [--device cuda] [--images 1024] [--batch 256]

Decodes ``--images`` synthetic ImageNet-like JPEGs (300-600 px a side) with ``blobdata.gpu.decode_batch``
in batches of ``--batch`` and makes training batches with ``gpu.TrainTransform`` (224, bfloat16,
channels-last). Prints images/s of the decode, of the transform and of both, the decoder used, the
transform's peak GPU memory per batch, and the difference between the device's batch and the same
boxes cut from Pillow's decode on the CPU (0-255 scale). On ``--device cpu`` (how CI checks the
script) the decode is Pillow's and the figures are the CPU's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from blobdata import gpu
from blobdata.testing import synthetic_jpeg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = gpu.check_device(args.device)
    cuda = device.type == "cuda"
    rng = np.random.default_rng(args.seed)
    datas = [synthetic_jpeg(rng, min_side=300, max_side=600) for _ in range(args.images)]
    urls = [f"mem://{k}.jpg" for k in range(args.images)]
    chunks = [range(a, min(a + args.batch, args.images)) for a in range(0, args.images, args.batch)]
    generator = torch.Generator().manual_seed(args.seed)
    t = gpu.TrainTransform(args.size, dtype=torch.bfloat16, generator=generator)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], object]) -> float:
        fn()  # warm-up: the decoder's and the kernels' first calls
        best = float("inf")
        for _ in range(args.repeat):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    decoded: list[list[torch.Tensor]] = []

    def decode() -> None:
        decoded.clear()
        for c in chunks:
            decoded.append(gpu.decode_batch([datas[k] for k in c], [urls[k] for k in c], device=device))

    decode()
    draws = [t.draw([(int(i.shape[1]), int(i.shape[2])) for i in images]) for images in decoded]

    def transform() -> None:
        for images, (boxes, flips) in zip(decoded, draws, strict=True):
            t.apply(images, boxes, flips)

    def both() -> None:
        decode()
        transform()

    name = gpu._gpu_decoder().__name__ if cuda else "Pillow, on the CPU"
    print(f"{args.images} JPEGs of 300-600 px, batches of {args.batch}, on {device} "
          f"({torch.cuda.get_device_name(device) if cuda else 'no GPU'}); decoder: {name}")  # fmt: skip
    for label, fn in (("decode", decode), ("TrainTransform", transform), ("decode + TrainTransform", both)):
        s = timed(fn)
        print(f"  {label:24s} {args.images / s:9.0f} images/s  ({s / len(chunks) * 1e3:7.2f} ms per batch)")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        transform()
        sync()
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        print(f"  TrainTransform's peak GPU memory above its inputs: {peak:.0f} MiB")
    # The same boxes from Pillow's decode on the CPU, both in float32 and 0-255: what the device changes.
    same = gpu.TrainTransform(args.size, mean=(0, 0, 0), std=(1 / 255,) * 3, channels_last=False)
    diffs = []
    for c, images, (boxes, flips) in zip(chunks, decoded, draws, strict=True):
        cpu = gpu.decode_batch([datas[k] for k in c], [urls[k] for k in c], device="cpu")
        out = same.apply(images, boxes, flips).cpu()
        diffs.append((out - same.apply(cpu, boxes, flips)).abs().mean().item())
    print(f"  against Pillow's decode and the CPU transform: mean abs difference {np.mean(diffs):.2f}/255")


if __name__ == "__main__":
    main()

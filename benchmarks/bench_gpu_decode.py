"""The GPU path's stages alone, as the training process runs them: no model, no bucket (issue 25, item 12).

    python benchmarks/bench_gpu_decode.py [--device cuda] [--images 1024] [--batch 256]
                                          [--decoder gpu|hw|default|torchvision] [--mix] [--json FILE]

Builds ``--images`` synthetic JPEGs (ImageNet-like, or ``--mix``: the realistic mix of gpu_images.py)
into raw batches of ``--batch`` as the workers would (``collate_raw``), then times, per image, each
thing the training process does with a batch: ``samples()`` (views of the batch's bytes; beside it
the ``.tobytes()`` copies it used to make), the crop boxes (``draw_keyed``, vectorised; beside it the
per-sample ``draw``), the decode (``--decoder``: nvImageCodec's GPU backends, its hardware decoder
alone, its defaults, or torchvision's nvJPEG; Pillow on ``--device cpu``), ``TrainTransform``, and
all of them together. Each row gives images/s and the training process's CPU time per image (all its
threads: ``time.process_time``), which is what the decode thread takes from the loop beside it.
Also: the JPEGs the decoder refused, the transform's peak GPU memory, and the difference between
the device's batch and the same boxes cut from Pillow's decode (0-255 scale).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from blobdata import gpu
from blobdata.gpu import _decoders
from blobdata.gpu._batch import decode_views
from blobdata.gpu._jpeg import prepare
from blobdata.gpu._pipeline import RawBatch, collate_raw
from blobdata.gpu._transform import epoch_seed
from blobdata.testing import synthetic_jpeg


def make_decoder(kind: str, device: torch.device) -> Any:
    if device.type == "cpu":
        return _decoders.PillowDecoder()
    if kind == "torchvision":
        return _decoders.TorchvisionDecoder(device)
    return _decoders.NvImageCodec(device, backends=kind)


def raw_batches(datas: list[bytes], batch: int) -> list[RawBatch]:
    """The workers' side: header read (CPU fallbacks decoded), bytes joined per batch."""
    samples = [(prepare(d, f"mem://{k}.jpg"), f"mem://{k}.jpg", k % 100) for k, d in enumerate(datas)]
    return [collate_raw(samples[a : a + batch]) for a in range(0, len(samples), batch)]


def measure(
    datas: list[bytes],
    *,
    device: torch.device,
    batch: int,
    decoder: str = "gpu",
    repeat: int = 3,
    size: int = 224,
) -> dict[str, Any]:
    """Images/s and training-process CPU ms/image of each stage (see the module docstring)."""
    cuda = device.type == "cuda"
    raws = raw_batches(datas, batch)
    n = sum(len(r.urls) for r in raws)
    dec = make_decoder(decoder, device)
    t = gpu.TrainTransform(size, dtype=torch.bfloat16 if cuda else torch.float32)
    seed = epoch_seed(0, 0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], object]) -> dict[str, float]:
        fn()  # warm-up: the decoder's and the kernels' first calls
        best, cpu = float("inf"), float("inf")
        for _ in range(repeat):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        return {
            "images_per_s": n / best,
            "cpu_ms_per_image": cpu * 1e3 / n,
            "ms_per_batch": best * 1e3 / len(raws),
        }

    decoded: list[list[torch.Tensor]] = []
    refused = [0]

    def decode() -> None:
        decoded.clear()
        refused[0] = 0
        for r in raws:
            shapes = [(int(h), int(w)) for h, w in r.shapes.tolist()]
            out, no = decode_views(dec, r.samples(), r.kinds.tolist(), shapes, r.urls, device)
            decoded.append([o for o in out if isinstance(o, torch.Tensor)])
            refused[0] += no

    decode()
    draws = [t.draw_keyed(r.shapes, r.keys, seed) for r in raws]

    def transform() -> None:
        for images, (boxes, flips) in zip(decoded, draws, strict=True):
            t.apply(images, boxes, flips)

    def everything() -> None:
        decode()
        for r, images in zip(raws, decoded, strict=True):
            t.apply(images, *t.draw_keyed(r.shapes, r.keys, seed))

    rows = {
        "samples() views": timed(lambda: [r.samples() for r in raws]),
        "samples() + .tobytes() (before)": timed(lambda: [[v.tobytes() for v in r.samples()] for r in raws]),
        "draw_keyed (vectorised)": timed(lambda: [t.draw_keyed(r.shapes, r.keys, seed) for r in raws]),
        "draw per sample (before)": timed(lambda: [t.draw(r.shapes.tolist()) for r in raws]),
        "decode": timed(decode),
        "TrainTransform.apply": timed(transform),
        "all: samples, decode, draw, transform": timed(everything),
    }
    result: dict[str, Any] = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "decoder": dec.name,
        "images": n,
        "batch": batch,
        "refused": refused[0],
        "worker_decoded": int(sum(int((r.kinds == 1).sum()) for r in raws)),
        "rows": rows,
    }
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        transform()
        sync()
        result["transform_peak_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    # The same boxes from Pillow's decode on the CPU, both in float32 and 0-255: what the device changes.
    same = gpu.TrainTransform(size, mean=(0, 0, 0), std=(1 / 255,) * 3, channels_last=False)
    cpu = _decoders.PillowDecoder()
    diffs = []
    for r, images, (boxes, flips) in zip(raws, decoded, draws, strict=True):
        if len(images) != len(r.urls):
            continue
        shapes = [(int(h), int(w)) for h, w in r.shapes.tolist()]
        ref, _ = decode_views(cpu, r.samples(), r.kinds.tolist(), shapes, r.urls, torch.device("cpu"))
        out = same.apply(images, boxes, flips).float().cpu()
        diffs.append((out - same.apply(ref, boxes, flips)).abs().mean().item())  # type: ignore[arg-type]
    result["mean_abs_diff_vs_pillow"] = float(np.mean(diffs)) if diffs else None
    return result


def print_result(r: dict[str, Any]) -> None:
    where = f"on {r['device']} ({r['gpu'] or 'no GPU'})"
    print(f"{r['images']} images, batches of {r['batch']}, {where}; decoder: {r['decoder']}; "
          f"refused {r['refused']}, decoded by the workers {r['worker_decoded']}")  # fmt: skip
    for label, row in r["rows"].items():
        rate, cpu = f"{row['images_per_s']:10.0f} images/s", f"{row['cpu_ms_per_image']:7.3f} CPU ms/image"
        print(f"  {label:38s} {rate}  {cpu}  ({row['ms_per_batch']:7.2f} ms per batch)")
    if "transform_peak_mib" in r:
        print(f"  TrainTransform's peak GPU memory above its inputs: {r['transform_peak_mib']:.0f} MiB")
    if r["mean_abs_diff_vs_pillow"] is not None:
        diff = r["mean_abs_diff_vs_pillow"]
        print(f"  against Pillow's decode and the CPU transform: mean abs difference {diff:.2f}/255")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decoder", default="gpu", choices=["gpu", "hw", "default", "torchvision"])
    p.add_argument("--mix", action="store_true", help="the realistic mix of gpu_images.py, not ImageNet-like")
    p.add_argument("--json", help="also write the result as JSON to this file")
    args = p.parse_args()
    device = gpu.check_device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.mix:
        from gpu_images import generate

        datas = [d for _, d in generate(args.images, seed=args.seed)]
    else:
        rng = np.random.default_rng(args.seed)
        datas = [synthetic_jpeg(rng, min_side=300, max_side=600) for _ in range(args.images)]
    r = measure(
        datas, device=device, batch=args.batch, decoder=args.decoder, repeat=args.repeat, size=args.size
    )
    print_result(r)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh, indent=1)


if __name__ == "__main__":
    main()

"""Per-sample cost of keyed augmentation draws (blobdata._sampling.rng) on the CPU path.

``RandomResizedCrop.decode_and_apply`` on photo-like JPEGs, drawing its box from torch's generator
(outside a loader) and from the keyed counter-based stream (inside one, with the per-sample marker
FolderDataset sets), interleaved, best of ``--repeat``; prints both and the ratio. The two draw other
boxes (of the same distribution), and a box's size sets the decode's cost: the whole-sample ratio
converges over many images; the draw alone is timed on one box size.

    python benchmarks/bench_keyed_draws.py [--images 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from blobdata._sampling import enter_sample, epoch_seed, leave_sample
from blobdata.testing import synthetic_jpeg
from blobdata.transforms import RandomResizedCrop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    jpegs = [synthetic_jpeg(rng) for _ in range(args.images)]
    crop = RandomResizedCrop(224)
    seed = epoch_seed(1, 0)

    def plain() -> None:
        for data in jpegs:
            crop.decode_and_apply(data, "s3://b/x.jpg")

    def keyed() -> None:
        for i, data in enumerate(jpegs):
            token = enter_sample(seed, f"s3://b/{i}.jpg")
            try:
                crop.decode_and_apply(data, f"s3://b/{i}.jpg")
            finally:
                leave_sample(token)

    def draws_only(keyed_: bool) -> float:
        t = time.perf_counter()
        for i in range(2000):
            if keyed_:
                token = enter_sample(seed, f"s3://b/{i}.jpg")
                crop._draw(500, 375)
                leave_sample(token)
            else:
                crop._draw(500, 375)
        return (time.perf_counter() - t) / 2000

    best = {"torch generator": float("inf"), "keyed": float("inf")}
    for _ in range(args.repeat):
        for name, fn in (("torch generator", plain), ("keyed", keyed)):
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t) / len(jpegs))
    d_plain, d_keyed = min(draws_only(False) for _ in range(3)), min(draws_only(True) for _ in range(3))
    t_plain, t_keyed = best["torch generator"], best["keyed"]
    print(f"per sample, decode+crop+resize: torch generator {t_plain * 1e3:.3f} ms, "
          f"keyed {t_keyed * 1e3:.3f} ms, ratio keyed/torch {t_keyed / t_plain:.3f}")
    print(f"the draw alone: torch generator {d_plain * 1e6:.1f} us, "
          f"keyed (marker included) {d_keyed * 1e6:.1f} us")


if __name__ == "__main__":
    main()

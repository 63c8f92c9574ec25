"""A vision-language mix: three folders of image-caption pairs read as one stream, by weight.

    python examples/mixing.py --source web 3 s3://bucket/laion --source coco 1 gs://bucket/coco \\
        --source curated 2 /data/curated --cache-dir /mnt/nvme/blobdata
    python examples/mixing.py --demo        # two folders on a local S3 server, one on local disk

Each source is a ``BlobDataset`` of ``x.jpg`` + ``x.txt`` pairs, each on its own store with its own
credentials and cache; ``blobdata.Mixture`` reads them as one stream, every epoch (and every batch)
exactly in proportion to the weights. ``with_source=True`` puts each sample's source in the batch, so
that the loop computes a loss per source. Each epoch prints the samples each source gave and what the
loader's statistics say per source (and which one limits the loop).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blobdata import BlobDataset, Mixture


def to_tensors(sample: dict[str, Any]) -> tuple[torch.Tensor, str]:
    image = sample["jpg"].resize((32, 32))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1), sample["txt"]


Source = tuple[str, float, str, "dict[str, Any] | None"]  # name, weight, URL, storage options


def run(sources: list[Source], cache_dir: str | None, epochs: int) -> None:
    mix = Mixture(
        {name: BlobDataset(url, transform=to_tensors, storage_options=opts, cache=cache_dir)
         for name, _, url, opts in sources},
        {name: weight for name, weight, _, _ in sources},
        with_source=True,
    )  # fmt: skip
    print(f"{mix!r}: {mix.samples_per_epoch} samples an epoch")
    # default_collate: (images, captions, sources); sources[k] is the number of a sample's source.
    loader = mix.dataloader(batch_size=8, num_workers=2)
    for epoch in range(epochs):
        seen: collections.Counter[str] = collections.Counter()
        losses: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        for images, _captions, source in loader:
            per_sample = images.float().mean(dim=(1, 2, 3)) / 255  # a stand-in for the model's loss
            for k, name in enumerate(mix.names):
                mask = source == k
                if mask.any():  # one loss per source: weigh, log or clip them apart
                    losses[name].append(float(per_sample[mask].mean()))
                    seen[name] += int(mask.sum())
        said = [f"{n} {seen[n]} samples, loss {np.mean(losses[n]):.3f}" for n in mix.names]
        print(f"epoch {epoch}: {', '.join(said)}")
    print(loader.stats().summary())


def demo(epochs: int, cache_dir: str | None) -> None:
    import tempfile

    from _demo import demo_bucket, image_bytes

    def pairs(folder: str, n: int, seed: int) -> dict[str, bytes]:
        out = {f"{folder}/{i:04d}.jpg": image_bytes(seed + i) for i in range(n)}
        out.update({f"{folder}/{i:04d}.txt": f"{folder} picture {i}".encode() for i in range(n)})
        return out

    with tempfile.TemporaryDirectory() as local, tempfile.TemporaryDirectory() as cache:
        for key, data in pairs("curated", 8, 900).items():
            (Path(local) / key).parent.mkdir(parents=True, exist_ok=True)
            (Path(local) / key).write_bytes(data)
        with demo_bucket({**pairs("web", 48, 0), **pairs("coco", 16, 500)}, "") as (url, opts):
            sources = [("web", 3, url + "web", opts), ("coco", 1, url + "coco", opts),
                       ("curated", 2, str(Path(local) / "curated"), None)]  # fmt: skip
            run(sources, cache_dir or cache, epochs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", nargs=3, action="append", metavar=("NAME", "WEIGHT", "URL"), default=[],
                   help="a source: its name, its weight (0 leaves it out) and its folder's URL")  # fmt: skip
    p.add_argument("--cache-dir", default=None, help="the node's cache, for every source (default: none)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--demo", action="store_true", help="start a local S3 server with synthetic pairs")
    args = p.parse_args()
    if args.demo:
        demo(args.epochs, args.cache_dir)
    elif not args.source:
        p.error("give --source NAME WEIGHT URL (several), or --demo")
    else:
        run([(n, float(w), u, None) for n, w, u in args.source], args.cache_dir, args.epochs)


if __name__ == "__main__":
    main()

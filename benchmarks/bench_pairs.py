"""Multi-file samples: image-caption pairs (``x.jpg`` + ``x.txt``) as a BlobDataset, next to the same images
as a FolderDataset, through a latency proxy (default RTT 50 ms); and time to the first batch from an index
of 1M rows next to a listing.

    python benchmarks/bench_pairs.py                     # 2000 pairs, RTT 50 ms, a 1,000,000-row index
    python benchmarks/bench_pairs.py --pairs 500 --index-rows 200000 --rounds 1   # a quick run

Starts a local S3 server (SeaweedFS, ``blobdata.testing.LocalS3Server``) behind
``blobdata.testing.LatencyProxy``; uploads ``--pairs`` synthetic JPEGs with a caption each under
``pairs/`` and the same JPEGs under ``folder/cNN/`` (ImageFolder's layout). Then, side by side in this
run, through the proxy, with no cache (every byte from the bucket), batch 64, 2 workers, shuffled:

* epoch: samples/s and GETs per sample of ``FolderDataset(folder)`` (1 object per sample) and of
  ``BlobDataset(pairs)`` (2 objects per sample, fetched together), both decoding the JPEG with Pillow;
  the listing is made before the clock starts. Median of ``--rounds``.
* first batch: seconds from nothing to the first batch (shuffle off) of ``BlobDataset(pairs,
  index=FILE)`` with FILE a CSV of ``--index-rows`` objects (the first ``2 * --pairs`` of them real:
  this machine cannot hold 1M uploads), next to ``BlobDataset(pairs, refresh=True)``, which lists the
  bucket, and the LIST requests each sent; and ``index=`` the same index saved once
  (``blobdata ls URL --index FILE --save-manifest PATH``), loaded without parsing. A listing of N
  objects takes ceil(N / 1000) pages one after the other; the last row extrapolates the listing's
  measured seconds per page to the index's row count (1000 pages for 1M objects) plus the rest of its
  first batch, plainly marked as an extrapolation.

A benchmark, not a test: no timed assertions; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BUCKET = "bench-pairs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2000, help="image-caption pairs (default 2000)")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round trip added by the proxy (default 50)")
    p.add_argument("--index-rows", type=int, default=1_000_000, help="rows of the index (default 1000000)")
    p.add_argument("--rounds", type=int, default=3, help="epochs per dataset, median reported (default 3)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--batch-size", type=int, default=64)
    return p.parse_args(argv)


def image_size(img: Any) -> tuple[int, int]:
    return img.size  # type: ignore[no-any-return]


def pair_size(sample: dict[str, Any]) -> tuple[int, int]:
    return sample["jpg"].size[0], len(sample["txt"])


def keep(batch: list[Any]) -> list[Any]:
    return batch


def epoch(ds: Any, args: argparse.Namespace, proxy: Any) -> tuple[float, float]:
    """(samples/s, GETs per sample) of one shuffled epoch."""
    loader = ds.dataloader(
        batch_size=args.batch_size, shuffle=True, num_workers=args.workers, collate_fn=keep
    )
    proxy.reset_counts()
    t0 = time.perf_counter()
    n = sum(len(b) for b in loader)
    dt = time.perf_counter() - t0
    gets = sum(1 for m, _ in proxy.requests if m == "GET")
    return n / dt, gets / n


def first_batch(make: Any, batch_size: int) -> tuple[float, int]:
    """(seconds from nothing to the first batch, requests made by construction)."""
    t0 = time.perf_counter()
    ds = make()
    loader = ds.dataloader(batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=keep)
    next(iter(loader))
    return time.perf_counter() - t0, len(ds)


def lists(proxy: Any) -> int:
    """LIST requests the proxy saw (a GET of the bucket with a query)."""
    return sum(1 for m, p in proxy.requests if m == "GET" and "?" in p)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np

    from blobdata import BlobDataset, FolderDataset
    from blobdata._listing import list_flat, save_table
    from blobdata.testing import LatencyProxy, LocalS3Server, s3_client, synthetic_jpeg, upload

    rng = np.random.default_rng(0)
    images = [synthetic_jpeg(rng, min_side=160, max_side=320) for _ in range(args.pairs)]
    objects: list[tuple[str, bytes]] = []
    for i, jpg in enumerate(images):
        objects += [(f"pairs/{i:07d}.jpg", jpg), (f"pairs/{i:07d}.txt", f"caption of picture {i}".encode())]
        objects.append((f"folder/c{i % 10:02d}/{i:07d}.jpg", jpg))
    mean_kb = sum(map(len, images)) / len(images) / 1e3
    with LocalS3Server() as server:
        server.create_bucket(BUCKET)
        t = time.perf_counter()
        upload(s3_client(server), BUCKET, objects)
        print(f"uploaded {len(objects)} objects ({args.pairs} pairs, JPEGs {mean_kb:.0f} KB on average) in "
              f"{time.perf_counter() - t:.0f}s", flush=True)  # fmt: skip
        host, _, port = server.endpoint_url.split("://", 1)[1].rstrip("/").rpartition(":")
        with (
            LatencyProxy(host, int(port), delay_s=args.rtt_ms / 2000) as proxy,
            tempfile.TemporaryDirectory() as tmp,
        ):
            opts = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
            folder = FolderDataset(f"s3://{BUCKET}/folder", transform=image_size, storage_options=opts)
            pairs = BlobDataset(f"s3://{BUCKET}/pairs", transform=pair_size, storage_options=opts)
            runs: dict[str, list[tuple[float, float]]] = {"FolderDataset": [], "BlobDataset": []}
            for _ in range(args.rounds):  # alternated, so that both see the same machine
                runs["FolderDataset"].append(epoch(folder, args, proxy))
                runs["BlobDataset"].append(epoch(pairs, args, proxy))
            index = Path(tmp) / "index.csv"
            with index.open("w") as fh:
                fh.write("key,size\n")
                for i in range(args.index_rows // 2):
                    real = i < args.pairs
                    fh.write(f"{i:07d}.jpg,{len(images[i]) if real else 1000}\n")
                    fh.write(f"{i:07d}.txt,{len(f'caption of picture {i}') if real else 20}\n")
            url = f"s3://{BUCKET}/pairs"
            proxy.reset_counts()
            t_index, n_index = first_batch(
                lambda: BlobDataset(url, index=index, storage_options=opts), args.batch_size
            )
            index_lists = lists(proxy)
            saved = Path(tmp) / "index.samples"  # as `blobdata ls URL --index FILE --save-manifest PATH`
            save_table(BlobDataset(url, index=index, storage_options=opts).table, saved)
            proxy.reset_counts()
            t_saved, _ = first_batch(
                lambda: BlobDataset(url, index=saved, storage_options=opts), args.batch_size
            )
            saved_lists = lists(proxy)
            proxy.reset_counts()
            t_list, _ = first_batch(
                lambda: BlobDataset(url, refresh=True, storage_options=opts), args.batch_size
            )
            list_lists = lists(proxy)
            t = time.perf_counter()
            list_flat(url, storage_options=opts)
            t_listing = time.perf_counter() - t
    listed = 2 * args.pairs
    pages = math.ceil(listed / 1000)
    per_page = t_listing / pages  # pages come one after the other
    # The listing's first batch for as many objects as the index names: its pages, then the rest as measured.
    extrapolated = per_page * math.ceil(args.index_rows / 1000) + max(0.0, t_list - t_listing)
    print(f"\nRTT {args.rtt_ms:.0f} ms, batch {args.batch_size}, {args.workers} workers, no cache, median of "
          f"{args.rounds} shuffled epochs")  # fmt: skip
    print(f"{'dataset':<16}{'objects/sample':>15}{'samples/s':>11}{'GETs/sample':>13}{'vs Folder':>11}")
    base = statistics.median(r[0] for r in runs["FolderDataset"])
    for name, per in (("FolderDataset", 1), ("BlobDataset", 2)):
        rate = statistics.median(r[0] for r in runs[name])
        gets = statistics.median(r[1] for r in runs[name])
        print(f"{name:<16}{per:>15}{rate:>11.0f}{gets:>13.2f}{rate / base:>10.2f}x")
    print(f"\ntime to the first batch (shuffle off, {args.batch_size} samples)")
    print(f"{'from':<44}{'objects':>10}{'LISTs':>10}{'seconds':>10}")
    label = f"index CSV ({args.index_rows:,} rows)"
    print(f"{label:<44}{args.index_rows:>10}{index_lists:>10}{t_index:>10.2f}")
    print(f"{'the index saved (--save-manifest)':<44}{args.index_rows:>10}{saved_lists:>10}{t_saved:>10.2f}")
    print(f"{'listing (measured)':<44}{listed:>10}{list_lists:>10}{t_list:>10.2f}")
    print(f"{'listing (extrapolated: ' + str(math.ceil(args.index_rows / 1000)) + ' pages)':<44}"
          f"{args.index_rows:>10}{'-':>10}{extrapolated:>10.1f}")  # fmt: skip
    print(f"index: {n_index:,} samples; listing alone: {t_listing:.2f}s for {pages} page(s), "
          f"{per_page:.3f}s per page")  # fmt: skip


if __name__ == "__main__":
    main()

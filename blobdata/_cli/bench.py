"""``blobdata bench URL``: the input pipeline alone, no model, with the user's settings; what it can give.

Runs a :class:`~blobdata.FolderDataset` loader for ``batches`` batches (as many epochs as that takes)
and reports the images/s and MB/s it reached, the cost per sample of each stage in the workers (the
wait for bytes, the cache read, decode, transform, collate), the hit rate, GET latencies and retries,
then a verdict and what to change. The numbers are the loader's own :meth:`~blobdata.BlobLoader.stats`;
the timeline (images/s and hit rate over windows of a few batches) is what ``--plot`` draws.

Verdicts: ``latency-bound`` (workers wait for the bucket longer than they work: the look-ahead does
not hide its latency), ``store-throttled`` (they wait for the bucket because it throttles: the node
sends what the store accepts, see :mod:`blobdata._fetch.throttle`), ``decode-bound`` (decode, transform and
collate take most of a sample's time: the cores are the limit). Advice follows from the measured
costs: ``W / (work + wait)`` img/s for W workers, ``cores / work`` at most for this machine's cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import ConfigError
from .._metrics import LoaderStats, stages, throttle_bound

__all__ = ["BenchResult", "add_parser", "advise", "command", "plot", "run_bench"]


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What one bench run measured; :meth:`as_dict` is the ``--json`` document."""

    settings: dict[str, Any]
    images: int
    seconds: float
    stats: LoaderStats
    timeline: list[dict[str, float]]  # {"t", "images_per_s", "hit_rate"} per window of batches
    verdict: str
    advice: list[str]

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        """Images/s times the mean bytes per object read (the workers also read ahead of the end)."""
        s = self.stats
        reads = s.samples_from_cache + s.samples_from_bucket
        per = (s.bytes_from_bucket + s.bytes_from_cache) / reads if reads else 0.0
        return self.images_per_s * per / 1e6

    def per_sample_ms(self) -> dict[str, float]:
        s = self.stats
        cost = stages(s)
        # The cache read happens inside the wait for bytes; shown apart, taken out of "fetch".
        return {
            "fetch": max(0.0, cost["fetch"] - s.cache_s_per_sample) * 1e3,
            "cache": s.cache_s_per_sample * 1e3,
            "decode": cost["decode"] * 1e3,
            "transform": cost["transform"] * 1e3,
            "collate": cost["collate"] * 1e3,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "images": self.images,
            "seconds": self.seconds,
            "images_per_s": self.images_per_s,
            "mb_per_s": self.mb_per_s,
            "hit_rate": self.stats.hit_rate,
            "per_sample_ms": self.per_sample_ms(),
            "verdict": self.verdict,
            "advice": self.advice,
            "stats": self.stats.as_dict(),
            "timeline": self.timeline,
        }

    def report(self) -> str:
        s, st = self.stats, self.settings
        cost = "  ".join(f"{k} {v:.2f}" for k, v in self.per_sample_ms().items())
        unit = st.get("unit", "images")
        per = "img/s" if unit == "images" else f"{unit}/s"
        lines = [
            f"blobdata bench {st['url']}: {st['batches']} batches of {st['batch_size']}, "
            f"{st['workers']} workers, lookahead {st['lookahead']}, cache {st['cache_dir'] or 'none'}, "
            f"transform {st['transform']}",
            f"  {self.images} {unit} in {self.seconds:.1f} s: {self.images_per_s:.0f} {per}, "
            f"{self.mb_per_s:.1f} MB/s, hit rate {s.hit_rate:.0%}",
            f"  per sample (ms, in a worker): {cost}",
            f"  GET: {s.gets} requests, p50 {s.get_p50_s * 1e3:.1f} ms, p99 {s.get_p99_s * 1e3:.1f} ms; "
            f"retries {s.retries} (throttled {s.retries_throttle}, 5xx {s.retries_server}, "
            f"timeout {s.retries_timeout}, reset {s.retries_connection}); {s.errors_skipped} skipped",
            f"  requests in flight: {s.concurrency_mean:.1f} on average; throttled answers {s.throttled} "
            f"({s.throttled_share:.0%})"
            + (f", the node allows {s.rate_limit:.0f} GET/s now" if s.rate_limit else ""),
            f"  verdict: {self.verdict}",
        ]
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: Workers waiting for bytes more than this share of their time: the look-ahead does not hide the latency.
HIDDEN = 0.2


def advise(
    s: LoaderStats, *, workers: int, lookahead: int, cache_dir: str | None, ncores: int
) -> tuple[str, list[str]]:
    """The verdict and what to change, from a loader's stats and its settings."""
    cost = stages(s)
    wait = cost["fetch"]
    work = cost["decode"] + cost["transform"] + cost["collate"]
    busy = wait + work
    procs = max(workers, 1)
    advice: list[str] = []
    if busy <= 0:
        return "unknown", ["no sample was served: nothing to judge"]
    verdict = "latency-bound" if wait > work else "decode-bound"
    if verdict == "latency-bound" and throttle_bound(s):
        verdict = "store-throttled"
        rate = s.gets / s.elapsed_s if s.elapsed_s > 0 else 0.0
        advice.append(
            f"the store throttles: {s.throttled} answers ({s.throttled_share:.0%}) asked to slow down, and "
            f"the node sent about {rate:.0f} GET/s, what it accepts; more workers or lookahead will not "
            "help: ask for a higher request rate (S3: spread the keys over more prefixes), or warm a "
            "cache with `blobdata warm` so that later epochs do not ask the store"
        )
    if (
        wait > HIDDEN * busy and verdict != "store-throttled"
    ):  # idle waiting for bytes a good part of the time
        hint = f"GET p50 {s.get_p50_s * 1e3:.0f} ms"
        if lookahead < 4 * max(s.samples // max(s.batches, 1), 1):
            advice.append(
                f"the bucket's latency is not hidden: workers wait {wait * 1e3:.2f} ms per sample for "
                f"bytes against {work * 1e3:.2f} ms of work ({hint}); raise lookahead (now {lookahead})"
            )
        else:
            advice.append(
                f"the bucket's latency is not hidden even with lookahead {lookahead} ({hint}, "
                f"{wait * 1e3:.2f} ms wait per sample): raise concurrency, lookahead or lookahead_bytes, "
                "or warm a cache with `blobdata warm`"
            )
    if verdict != "store-throttled" and (
        workers < ncores or (verdict == "latency-bound" and workers < 4 * ncores)
    ):
        advice.append(
            f"more workers would help: {procs} give at most {procs / busy:.0f} img/s at these costs, "
            f"{ncores} cores about {ncores / work:.0f} img/s once the wait is hidden"
        )
    if verdict == "decode-bound":
        top = max(("decode", "transform", "collate"), key=lambda k: cost[k])
        advice.append(
            f"{top} is the limit: {ncores} cores give at most {ncores / work:.0f} img/s "
            f"({work * 1e3:.2f} ms of CPU per sample); try the GPU path (decode on the GPU) or a "
            "cheaper transform"
        )
    if cache_dir is None and s.hit_rate == 0:
        advice.append(
            "no cache: every epoch reads the bucket; pass --cache-dir (an SSD; cache= in Python) to read "
            "later epochs locally"
        )
    return verdict, advice


def run_bench(
    url: str,
    *,
    batches: int = 50,
    batch_size: int = 64,
    workers: int = 2,
    cache_dir: str | None = None,
    cache_size: int | str | None = None,
    lookahead: int = 1024,
    transform: Callable[[Any], Any] | None = None,
    transform_name: str = "custom",
    storage_options: dict[str, Any] | None = None,
    dataset_kwargs: dict[str, Any] | None = None,
    points: int = 40,
    progress: bool = False,
    blob: bool = False,
) -> BenchResult:
    """Iterate a loader over ``url`` for ``batches`` batches with these settings; measure it.

    ``transform=None`` decodes only and does not collate samples into tensors (PIL images do not
    stack). The timeline has about ``points`` points. ``dataset_kwargs`` go to
    :class:`~blobdata.FolderDataset` (manifest, refresh, fetch_options, extensions), or with ``blob``
    to :class:`~blobdata.BlobDataset` (index, metadata, manifest, refresh, fetch_options): then
    ``transform`` applies to each image member of a sample, and the samples, made in the workers, reach
    the loop as their keys (the unit is a sample, not an image).
    """
    from .._cache import BlobCache
    from .._dataset import BlobDataset, FolderDataset

    if batches < 1 or batch_size < 1 or workers < 0:
        raise ConfigError("bench needs batches >= 1, batch_size >= 1 and workers >= 0")
    cache = BlobCache(cache_dir, size_limit=cache_size) if cache_dir else None
    ds: Any
    if blob:
        each = _EachImage(transform) if transform is not None else None
        ds = BlobDataset(url, transform=each, storage_options=storage_options, cache=cache,
                         lookahead=lookahead, **(dataset_kwargs or {}))  # fmt: skip
        collate: Any = _keys_only
    else:
        ds = FolderDataset(url, transform=transform, storage_options=storage_options, cache=cache,
                           lookahead=lookahead, **(dataset_kwargs or {}))  # fmt: skip
        collate = None if transform is not None else _targets_only
    loader = ds.dataloader(
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        collate_fn=collate,
    )
    bar = _bar(batches, progress)
    images = done = 0
    # Per batch: (seconds, images yielded, samples read from the cache, from the bucket), cumulative.
    marks: list[tuple[float, int, int, int]] = [(0.0, 0, 0, 0)]
    t0 = time.perf_counter()
    try:
        while done < batches:
            for batch in loader:
                images += len(batch) if transform is None or blob else len(batch[-1])
                done += 1
                bar.update(1)
                cur = loader.stats()
                marks.append(
                    (time.perf_counter() - t0, images, cur.samples_from_cache, cur.samples_from_bucket)
                )
                if done >= batches:
                    break
        seconds = time.perf_counter() - t0
        stats = loader.stats()
    finally:
        bar.close()
        del loader  # persistent workers stop
        ds.close()
    verdict, advice = advise(stats, workers=workers, lookahead=lookahead, cache_dir=cache_dir, ncores=cores())
    settings = {
        "url": url, "batches": batches, "batch_size": batch_size, "workers": workers,
        "cache_dir": cache_dir, "lookahead": lookahead, "transform": transform_name, "cores": cores(),
        "unit": "samples" if blob else "images",
    }  # fmt: skip
    return BenchResult(settings, images, seconds, stats, _timeline(marks, points), verdict, advice)


def _timeline(marks: list[tuple[float, int, int, int]], points: int) -> list[dict[str, float]]:
    """Images/s and hit rate over about ``points`` windows of equal time (batches arrive in bursts:
    a rate per batch would be noise)."""
    total = marks[-1][0]
    width = total / max(1, min(points, len(marks) - 1))
    ends = [marks[0]]
    for cur in marks[1:]:
        if cur[0] - ends[-1][0] >= width:
            ends.append(cur)
    if ends[-1] is not marks[-1]:  # the tail: its own window, or folded into the last one if short
        if len(ends) > 1 and marks[-1][0] - ends[-1][0] < width / 2:
            ends[-1] = marks[-1]
        else:
            ends.append(marks[-1])
    out: list[dict[str, float]] = []
    hit_rate = 0.0
    for (t0, n0, c0, b0), (t1, n1, c1, b1) in itertools.pairwise(ends):
        reads = (c1 + b1) - (c0 + b0)
        if reads:
            hit_rate = (c1 - c0) / reads  # else the last one holds: nothing was read in this window
        out.append({"t": t1, "images_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0, "hit_rate": hit_rate})
    return out


def _targets_only(batch: list[tuple[Any, int]]) -> list[int]:
    """Collate for decode-only runs: the decoded samples are dropped, the targets kept."""
    return [t for _, t in batch]


def _keys_only(batch: list[dict[str, Any]]) -> list[str]:
    """Collate for a BlobDataset's samples: made in the workers, dropped there; their keys kept."""
    return [s["__key__"] for s in batch]


class _EachImage:
    """A BlobDataset transform: ``transform`` applied to each image member of the sample (a dict)."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        from PIL import Image

        return {k: self.transform(v) if isinstance(v, Image.Image) else v for k, v in sample.items()}


def _bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="batch", file=sys.stderr, disable=not enabled, leave=False)


def plot(result: BenchResult, path: str) -> None:
    """Write a PNG of images/s and hit rate over time (needs matplotlib: ``pip install blobdata[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'blobdata[plot]' (or pip install matplotlib)"
        ) from exc
    t = [p["t"] for p in result.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5))
    top.plot(t, [p["images_per_s"] for p in result.timeline], marker=".", color="tab:blue")
    top.axhline(
        result.images_per_s, linestyle="--", color="tab:gray", label=f"mean {result.images_per_s:.0f}"
    )
    top.set_ylabel("images/s")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    top.set_title(f"blobdata bench {result.settings['url']}: {result.verdict}", fontsize=10)
    bottom.plot(t, [p["hit_rate"] * 100 for p in result.timeline], marker=".", color="tab:green")
    bottom.set_ylabel("cache hit rate (%)")
    bottom.set_ylim(-5, 105)
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the command line -------------------------------------------------------------------------------
def add_parser(
    sub: Any, parents: Sequence[argparse.ArgumentParser], func: Callable[[argparse.Namespace], int]
) -> None:
    """Register ``blobdata bench`` on the command line's sub-parsers; ``func`` runs it."""
    b = sub.add_parser(
        "bench", parents=list(parents), help="run the input pipeline alone and say what limits it"
    )
    b.add_argument("--batches", type=int, default=50, help="batches to run (default 50)")
    b.add_argument("--batch-size", type=int, default=64, help="samples per batch (default 64)")
    b.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    b.add_argument("--cache-dir", help="cache directory (default: none)")
    b.add_argument("--cache-size", help="raise the cache's size bound to this (default: the stored one)")
    b.add_argument(
        "--lookahead", type=int, default=1024, help="samples fetched ahead per worker (default 1024)"
    )
    b.add_argument(
        "--transform", choices=["train", "none"], default="train",
        help="train: random-resized-crop 224, flip, uint8 tensor (default); none: decode only",
    )  # fmt: skip
    b.add_argument("--plot", metavar="PATH.png", help="write throughput and hit rate over time (matplotlib)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=func)


def command(
    args: argparse.Namespace,
    *,
    storage_options: dict[str, Any],
    extensions: tuple[str, ...] | None,
    blob: bool = False,
    header: Sequence[str] = (),
) -> int:
    """``blobdata bench`` with its parsed arguments (the command line parses the shared options and
    chooses the layout: ``blob`` for a BlobDataset's; ``header``: lines printed before the report)."""
    from .._config import FetchOptions

    transform: Callable[[Any], Any] | None = None
    if args.transform == "train":
        from ..testing import TrainTransform

        transform = TrainTransform()
    kwargs: dict[str, Any] = {
        "manifest": args.manifest, "refresh": args.refresh,
        "fetch_options": FetchOptions(concurrency=args.concurrency),
    }  # fmt: skip
    kwargs.update({"index": args.index, "metadata": args.metadata} if blob else {"extensions": extensions})
    result = run_bench(
        args.url,
        batches=args.batches,
        batch_size=args.batch_size,
        workers=args.workers,
        cache_dir=args.cache_dir,
        cache_size=args.cache_size,
        lookahead=args.lookahead,
        transform=transform,
        transform_name=args.transform,
        storage_options=storage_options,
        dataset_kwargs=kwargs,
        progress=not args.quiet and not args.json and sys.stderr.isatty(),
        blob=blob,
    )
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps({**result.as_dict(), "notes": list(header)}, indent=2))
    else:
        print("\n".join([*header, result.report()]))
        if args.plot:
            print(f"  plot: {args.plot}")
    return 0

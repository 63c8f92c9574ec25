"""One small adapter per system the latency benchmark compares.

Every adapter takes a :class:`Target` (where the data is, the loader settings) and returns a
:class:`Prepared`: the epochs to time, each an iterable of ``(uint8 images [B,3,224,224], labels [B])``
batches, plus the time spent before the first epoch (listing, indexing) that is reported apart.
Every system does the same per-sample work (:class:`common.SampleWork`) in ``workers`` DataLoader
worker processes; adapters differ only in how the bytes of a sample reach the worker.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import SampleWork
from torch.utils.data import DataLoader, Dataset

Batch = Any


@dataclasses.dataclass(frozen=True)
class Target:
    """What a system run knows. ``endpoint_url`` is the latency proxy's (or the server's at RTT 0)."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    bucket: str
    image_prefix: str
    keys: list[str]  # image keys in the bucket, equal to their paths under local_root
    classes: list[str]
    shard_urls: list[str]  # presigned GET URLs of the WebDataset shards, through the same endpoint
    local_root: str
    scratch: str  # a fresh empty directory for this run's caches
    workers: int = 2
    batch_size: int = 64
    seed: int = 0

    def s3fs_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options for the endpoint, with bounded connect/read timeouts (seconds)."""
        config = {"connect_timeout": 10, "read_timeout": 60, **extra}
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": self.region},
            "config_kwargs": config,
        }

    def label(self, key: str) -> int:
        return self.classes.index(key.rsplit("/", 2)[-2])

    def loader(self, dataset: Any, **kwargs: Any) -> DataLoader[Any]:
        """The DataLoader every map-style system uses: shuffled, seeded, workers exit after the epoch."""
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.workers,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=False,
            **kwargs,
        )


@dataclasses.dataclass
class Prepared:
    """Epochs to time, named as the table rows; ``setup_s`` is spent before them (listing, indexing)."""

    epochs: list[tuple[str, Iterable[Batch]]]
    setup_s: float = 0.0
    note: str = ""
    close: Callable[[], None] = lambda: None


class _KeyDataset(Dataset[tuple[torch.Tensor, int]]):
    """Map-style dataset over keys; ``read(key) -> bytes`` is built lazily in each process."""

    def __init__(self, target: Target, make_reader: Callable[[], Callable[[str], bytes]]) -> None:
        self.keys = target.keys
        self.labels = [target.label(k) for k in target.keys]
        self.work = SampleWork()
        self._make_reader = make_reader
        self._reader: Callable[[str], bytes] | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._reader is None or self._pid != os.getpid():
            self._reader, self._pid = self._make_reader(), os.getpid()
        return self.work(self._reader(self.keys[i])), self.labels[i]


def local_disk(t: Target) -> Prepared:
    """(1) The folder on local disk (page cache warm): ``open().read()`` per sample."""
    root = Path(t.local_root)

    def make() -> Callable[[str], bytes]:
        return lambda key: (root / key).read_bytes()

    return Prepared([("local disk", t.loader(_KeyDataset(t, make)))])


def naive_s3fs(t: Target) -> Prepared:
    """(2) One ``s3fs.cat_file`` per sample in ``__getitem__``: one request at a time per worker."""
    opts = t.s3fs_options()

    def make() -> Callable[[str], bytes]:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
        return lambda key: fs.cat_file(f"{t.bucket}/{key}")

    return Prepared([("naive s3fs", t.loader(_KeyDataset(t, make)))])


def fsspec_filecache(t: Target) -> Prepared:
    """(3) fsspec ``filecache::s3://``: each sample opened through a local whole-file cache (cold)."""
    opts = t.s3fs_options()
    cache = os.path.join(t.scratch, "filecache")

    def make() -> Callable[[str], bytes]:
        import fsspec

        fs = fsspec.filesystem(
            "filecache",
            target_protocol="s3",
            target_options=opts,
            cache_storage=cache,
            skip_instance_cache=True,
        )

        def read(key: str) -> bytes:
            with fs.open(f"{t.bucket}/{key}", "rb") as f:
                return f.read()  # type: ignore[no-any-return]

        return read

    return Prepared([("fsspec filecache", t.loader(_KeyDataset(t, make)))])


def webdataset(t: Target) -> Prepared:
    """(4) WebDataset streaming the tar shards with its ``pipe:curl`` opener (presigned URLs).

    Shards are shuffled and split by worker; samples go through a 1000-sample shuffle buffer (WebDataset's
    usual setting), then the same decode and transform.
    """
    import webdataset as wds

    work = SampleWork()
    # --max-time bounds each shard download; -f turns HTTP errors into a failed pipe (an exception).
    urls = [f"pipe:curl -sSf --connect-timeout 10 --max-time 600 '{u}'" for u in t.shard_urls]
    ds = (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            workersplitter=wds.split_by_worker,
            seed=t.seed,
            empty_check=False,
        )
        .shuffle(1000)
        .to_tuple("jpg", "cls")
        .map_tuple(work, lambda b: int(b))
    )
    loader = DataLoader(ds, batch_size=t.batch_size, num_workers=t.workers, persistent_workers=False)
    return Prepared([("WebDataset", loader)], note=f"{len(urls)} shards")


class _LitLabelled(Dataset[tuple[torch.Tensor, int]]):
    """LitData's raw dataset returns bytes; this adds the label from the path and the same work."""

    def __init__(self, raw: Any, target: Target) -> None:
        self.raw = raw
        self.work = SampleWork()
        self.labels = [target.label(item.path) for item in raw.items]

    def __len__(self) -> int:
        return len(self.raw)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        datas = self.raw.__getitems__(list(indices))
        return [(self.work(d), self.labels[i]) for i, d in zip(indices, datas, strict=True)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([i])[0]


def litdata(t: Target) -> Prepared:
    """(5) LitData ``StreamingRawDataset`` over the raw folder (its own concurrent downloads per batch).

    LitData takes the endpoint from the environment (``AWS_ENDPOINT_URL`` and the AWS key variables, set
    by the harness for this child process): its boto3 client and its fsspec indexer read
    ``storage_options`` with different meanings, so none are passed. Samples are fetched per batch through
    ``__getitems__`` (concurrent GETs in each worker), shuffled by the DataLoader like the others.
    """
    import litdata.streaming.downloader as lit_downloader
    from litdata import StreamingRawDataset
    from litdata.raw.indexer import FileIndexer

    if t.endpoint_url.startswith("http://"):
        # LitData downloads through obstore with fixed client options that refuse plain http (and ignore
        # AWS_ALLOW_HTTP); the local test server has no TLS, so allow it. A no-op against real S3.
        lit_downloader._OBSTORE_CLIENT_OPTIONS = {
            **lit_downloader._OBSTORE_CLIENT_OPTIONS,
            "allow_http": True,
        }

    t0 = time.perf_counter()
    raw = StreamingRawDataset(
        f"s3://{t.bucket}/{t.image_prefix}/",
        cache_dir=os.path.join(t.scratch, "litdata"),
        indexer=FileIndexer(extensions=[".jpeg"]),
    )
    setup = time.perf_counter() - t0
    ds = _LitLabelled(raw, t)
    return Prepared([("LitData raw", t.loader(ds))], setup_s=setup, note="setup = its indexing")


def _blobdata_loader(t: Target, cache_dir: str | None) -> tuple[Any, Any, float]:
    """(dataset, loader, listing seconds) of a FolderDataset over the bucket, fresh manifest home."""
    os.environ["BLOBDATA_CACHE_HOME"] = os.path.join(t.scratch, "blobdata-home")
    from blobdata import BlobCache, FolderDataset
    from blobdata.testing import TrainTransform

    t0 = time.perf_counter()
    ds = FolderDataset(
        f"s3://{t.bucket}/{t.image_prefix}",
        transform=TrainTransform(224),
        storage_options=t.s3fs_options(),
        cache=BlobCache(cache_dir, size_limit="50GB") if cache_dir else None,
    )
    setup = time.perf_counter() - t0
    if len(ds) != len(t.keys):
        raise RuntimeError(f"blobdata listed {len(ds)} samples, expected {len(t.keys)}")
    loader = ds.dataloader(
        batch_size=t.batch_size,
        shuffle=True,
        num_workers=t.workers,
        generator=torch.Generator().manual_seed(t.seed),
        persistent_workers=False,
    )
    return ds, loader, setup


def blobdata(t: Target) -> Prepared:
    """(6, 7) blobdata FolderDataset: a cold epoch (fresh cache and manifest home), then a warm one."""
    ds, loader, setup = _blobdata_loader(t, os.path.join(t.scratch, "blobdata-cache"))
    return Prepared(
        [("blobdata cold", loader), ("blobdata warm", loader)],
        setup_s=setup,
        note="setup = its listing",
        close=ds.close,
    )


def blobdata_nocache(t: Target) -> Prepared:
    """blobdata without a cache dir: one cold epoch, isolating what the cache writes cost (diagnostic)."""
    ds, loader, setup = _blobdata_loader(t, None)
    return Prepared([("blobdata no cache", loader)], setup_s=setup, note="cache_dir=None", close=ds.close)


SYSTEMS: dict[str, Callable[[Target], Prepared]] = {
    "local": local_disk,
    "naive": naive_s3fs,
    "filecache": fsspec_filecache,
    "webdataset": webdataset,
    "litdata": litdata,
    "blobdata": blobdata,
    "blobdata-nocache": blobdata_nocache,
}

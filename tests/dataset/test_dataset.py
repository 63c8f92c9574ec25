"""FolderDataset end to end against the real S3 server started by the suite."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from blobdata import (
    AccessDenied,
    BlobCache,
    DecodeError,
    EmptyDatasetError,
    FetchOptions,
    FolderDataset,
    NotFound,
)

pytestmark = pytest.mark.network

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _png(seed: int, size: tuple[int, int] = (8, 6)) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


# A tree exercising ImageFolder's rules: nested files, mixed-case extensions, non-image files,
# unicode, spaces and '+', files directly under the root (not samples), sibling dir names that sort
# differently as paths ("b" vs "b-x").
TREE_KEYS = [
    "cat/1.jpg",
    "cat/10.JPG",
    "cat/2.png",
    "cat/notes.txt",
    "cat/b/inner.jpeg",
    "cat/b-x/inner2.jpg",
    "cat/b/deeper/z.PNG",
    "dog/a b+c.jpg",
    "dog/ünï cödé.webp",
    "dog/README",
    "emu/only.bmp",
    "root-level.jpg",
]


def _tree() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for n, key in enumerate(TREE_KEYS):
        ext = key.rsplit(".", 1)[-1].lower() if "." in key else ""
        if ext in ("jpg", "jpeg"):
            out[key] = _jpeg(n)
        elif ext == "webp":
            buf = io.BytesIO()
            Image.new("RGB", (5, 5), (n, 2, 3)).save(buf, format="WEBP")
            out[key] = buf.getvalue()
        elif ext == "bmp":
            buf = io.BytesIO()
            Image.new("RGB", (5, 5), (n, 2, 3)).save(buf, format="BMP")
            out[key] = buf.getvalue()
        elif ext == "png":
            out[key] = _png(n)
        else:
            out[key] = b"not an image"
    return out


def _write_local(root: str, tree: dict[str, bytes]) -> None:
    for key, data in tree.items():
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)


def reference_make_dataset(directory: str) -> tuple[list[str], list[tuple[str, int]]]:
    """torchvision's find_classes + make_dataset, re-implemented from its documented behaviour."""
    classes = sorted(e.name for e in os.scandir(directory) if e.is_dir())
    samples: list[tuple[str, int]] = []
    for idx, cls in enumerate(classes):
        for root, _, fnames in sorted(os.walk(os.path.join(directory, cls), followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if path.lower().endswith(IMG_EXTENSIONS):
                    samples.append((path, idx))
    return classes, samples


def _rel(samples: Any, prefix: str) -> list[tuple[str, int]]:
    return [(p[len(prefix) :].lstrip("/"), t) for p, t in samples]


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())


def _sum_loader(f: Any) -> int:
    """A picklable loader: the byte sum identifies the object's content exactly enough for these tests."""
    return int(np.frombuffer(f.read(), dtype=np.uint8).sum())


@pytest.fixture
def tree_bucket(s3_bucket: Any, tmp_path: Any) -> Iterator[tuple[Any, str]]:
    tree = _tree()
    s3_bucket.put_many({f"data/{k}": v for k, v in tree.items()})
    local = str(tmp_path / "data")
    _write_local(local, tree)
    yield s3_bucket, local


def test_imagefolder_parity_on_s3_and_local_disk(tree_bucket: tuple[Any, str]) -> None:
    bucket, local = tree_bucket
    classes, expected = reference_make_dataset(local)
    want = _rel(expected, local)
    remote = FolderDataset(bucket.url("data"), storage_options=bucket.storage_options)
    on_disk = FolderDataset(local)
    for ds, prefix in ((remote, bucket.url("data")), (on_disk, local)):
        assert ds.classes == classes == ["cat", "dog", "emu"]
        assert ds.class_to_idx == {c: i for i, c in enumerate(classes)}
        assert _rel(ds.samples, prefix) == want
        assert list(ds.targets) == [t for _, t in expected]
        assert len(ds) == len(expected)
    # local samples are plain paths, as ImageFolder gives them
    assert [p for p, _ in on_disk.samples] == [p for p, _ in expected]


def test_samples_decode_to_the_same_pixels_as_local_files(tree_bucket: tuple[Any, str]) -> None:
    bucket, local = tree_bucket
    ds = FolderDataset(bucket.url("data"), transform=to_tensor, storage_options=bucket.storage_options)
    _, expected = reference_make_dataset(local)
    batch = ds.__getitems__(list(range(len(ds))))
    for (img, target), (path, want_target) in zip(batch, expected, strict=True):
        with Image.open(path) as ref:
            assert torch.equal(img, to_tensor(ref.convert("RGB")))
        assert target == want_target
    img0, t0 = ds[0]
    assert torch.equal(img0, batch[0][0]) and t0 == batch[0][1]
    with pytest.raises(IndexError):
        ds[len(ds)]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_under_every_start_method(s3_bucket: Any, method: str) -> None:
    objects = {f"ds/c{i % 3}/{i}.png": _png(i) for i in range(24)}
    s3_bucket.put_many(objects)
    ds = FolderDataset(s3_bucket.url("ds"), loader=_sum_loader, storage_options=s3_bucket.storage_options)
    want = sorted(
        (int(np.frombuffer(v, np.uint8).sum()), int(k.split("/")[1][1:])) for k, v in objects.items()
    )
    for loader in (
        ds.dataloader(batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=method),
        torch.utils.data.DataLoader(
            ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=method
        ),
    ):
        got = sorted((int(s), int(t)) for sums, targets in loader for s, t in zip(sums, targets, strict=True))
        assert got == want


def test_second_construction_reuses_the_listing(s3_bucket: Any, s3_proxy: Any) -> None:
    s3_bucket.put_many({f"m/c{i % 2}/{i}.png": _png(i) for i in range(6)})
    url = s3_bucket.url("m")
    first = FolderDataset(url, storage_options=s3_proxy.storage_options)
    assert len(s3_proxy.requests) > 0
    s3_proxy.reset_counts()
    second = FolderDataset(url, storage_options=s3_proxy.storage_options)
    assert s3_proxy.requests == []
    assert list(second.samples) == list(first.samples)
    FolderDataset(url, storage_options=s3_proxy.storage_options, refresh=True)
    assert any(m == "GET" for m, _ in s3_proxy.requests)


def test_construction_errors_name_the_url(s3_bucket: Any) -> None:
    opts = s3_bucket.storage_options
    with pytest.raises(NotFound) as info:
        FolderDataset(f"s3://{s3_bucket.name}-missing/x", storage_options=opts)
    assert f"{s3_bucket.name}-missing" in str(info.value)
    s3_bucket.put("present/c/1.png", _png(1))
    with pytest.raises(NotFound) as info:
        FolderDataset(s3_bucket.url("absent"), storage_options=opts)
    assert s3_bucket.url("absent") in str(info.value)
    bad = dict(opts, secret="wrong-secret-value")
    with pytest.raises(AccessDenied) as denied:
        FolderDataset(s3_bucket.url("present"), storage_options=bad, refresh=True)
    assert "wrong-secret-value" not in str(denied.value)


def test_wrong_endpoint_fails_fast_with_the_url(s3_bucket: Any) -> None:
    from blobdata.testing import find_free_port

    opts = dict(s3_bucket.storage_options, endpoint_url=f"http://127.0.0.1:{find_free_port()}")
    with pytest.raises(OSError) as info:
        FolderDataset(
            s3_bucket.url("x"), storage_options=opts, fetch_options=FetchOptions(attempts=2, timeout=5)
        )
    assert s3_bucket.name in str(info.value)


def test_unfetchable_and_undecodable_samples(s3_bucket: Any, caplog: pytest.LogCaptureFixture) -> None:
    s3_bucket.put_many({"e/c/0.png": _png(0), "e/c/1.png": b"\x89PNG garbage", "e/c/2.png": _png(2)})
    ds = FolderDataset(s3_bucket.url("e"), storage_options=s3_bucket.storage_options)
    s3_bucket.delete("e/c/2.png")  # gone after the listing
    with pytest.raises(DecodeError) as bad:
        ds[1]
    assert bad.value.url == s3_bucket.url("e/c/1.png")
    with pytest.raises(NotFound) as gone:
        ds.__getitems__([0, 2])
    assert s3_bucket.url("e/c/2.png") in str(gone.value)

    seen: list[str] = []
    skipping = FolderDataset(
        s3_bucket.url("e"),
        storage_options=s3_bucket.storage_options,
        on_error=lambda url, exc: seen.append(url),
    )
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        batch = skipping.__getitems__([0, 1, 2])
    assert len(batch) == 1
    assert sorted(seen) == [s3_bucket.url("e/c/1.png"), s3_bucket.url("e/c/2.png")]
    assert [u for u, _ in skipping.errors] == seen
    logged = caplog.text
    assert s3_bucket.url("e/c/1.png") in logged and s3_bucket.url("e/c/2.png") in logged
    # __getitem__ under "skip" hands out the next good sample, and still reports the bad one
    assert skipping[1][1] == 0


def test_keys_as_they_come(verbatim_s3: Any, tmp_path: Any) -> None:
    from tests.support import buckets

    s3_bucket = buckets.s3_bucket(verbatim_s3)
    keys = ["k/c/ü ñ +.png", "k/c/x/../up.png", "k/c//double.png", "k/c/plus+sign.png", "k/c/./dot.png"]
    payload = {key: _png(i) for i, key in enumerate(keys)}
    s3_bucket.put_many(payload)
    s3_bucket.put("k/d/", b"")  # a zero-byte directory marker: an (empty) class, not a sample
    with pytest.raises(EmptyDatasetError, match="d"):
        FolderDataset(s3_bucket.url("k"), storage_options=s3_bucket.storage_options)
    cache = tmp_path / "inner" / "cache"
    ds = FolderDataset(
        s3_bucket.url("k"),
        loader=lambda f: f.read(),
        storage_options=s3_bucket.storage_options,
        allow_empty=True,
        cache=str(cache),
        refresh=True,
    )
    assert ds.classes == ["c", "d"]
    batch = ds.__getitems__(list(range(len(ds))))
    got = {url: data for (url, _), (data, _) in zip(ds.samples, batch, strict=True)}
    assert got == {s3_bucket.url(k): v for k, v in payload.items()}
    # nothing was written outside the cache directory
    assert sorted(p.name for p in (tmp_path / "inner").iterdir()) == ["cache"]
    assert [p for p in tmp_path.rglob("*") if not str(p).startswith(str(cache))] == [tmp_path / "inner"]


class _TracingDataset(FolderDataset):
    """Records the order in which loads start (in this process: num_workers=0)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trace: list[int] = []

    async def _load(self, i: int) -> bytes:
        self.trace.append(i)
        return await super()._load(i)


def test_fetch_order_follows_the_sampler(s3_bucket: Any) -> None:
    s3_bucket.put_many({f"o/c{i % 4}/{i:03d}.png": _png(i) for i in range(80)})
    ds = _TracingDataset(
        s3_bucket.url("o"), loader=_sum_loader, storage_options=s3_bucket.storage_options, lookahead=1000
    )
    gen = torch.Generator().manual_seed(1234)
    loader = ds.dataloader(batch_size=8, shuffle=True, generator=gen, num_workers=0)
    seen = sum(len(targets) for _, targets in loader)
    plain = torch.utils.data.DataLoader(
        list(range(len(ds))), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1234)
    )
    expected = [int(i) for batch in plain for i in batch]  # a plain DataLoader's order, same seed
    # loads start exactly in the shuffled order: the first batch on demand, the rest ahead of it
    assert ds.trace == expected
    assert seen == 80


def test_distributed_ranks_fetch_disjoint_shares(s3_bucket: Any) -> None:
    s3_bucket.put_many({f"r/c{i % 2}/{i:03d}.png": _png(i) for i in range(30)})
    fetched = []
    for rank in range(2):
        ds = _TracingDataset(
            s3_bucket.url("r"), loader=_sum_loader, storage_options=s3_bucket.storage_options
        )
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(3)
        want = list(sampler)
        list(ds.dataloader(batch_size=4, sampler=sampler, num_workers=0))
        assert ds.trace == want
        fetched.append(set(ds.trace))
    assert not fetched[0] & fetched[1]
    assert fetched[0] | fetched[1] == set(range(30))


def test_staging_area_stays_within_its_bounds(s3_bucket: Any) -> None:
    s3_bucket.put_many({f"s/c/{i:03d}.png": _png(i, (64, 64)) for i in range(60)})
    ds = FolderDataset(
        s3_bucket.url("s"),
        loader=_sum_loader,
        storage_options=s3_bucket.storage_options,
        lookahead=10,
        lookahead_bytes=5 * 13_000,
    )
    biggest = int(ds.manifest.sizes.max())
    assert biggest <= 13_000
    list(ds.dataloader(batch_size=4, shuffle=True, num_workers=0))
    stager = ds._proc.lookahead.stager  # type: ignore[union-attr]
    assert stager is not None
    assert 0 < stager.peak_items <= 10
    assert 0 < stager.peak_bytes <= 5 * 13_000
    assert len(stager) == 0 and stager.staged_bytes == 0  # consumed items are dropped


def test_look_ahead_ramps_up_over_the_first_batches(s3_bucket: Any) -> None:
    s3_bucket.put_many({f"ramp/c/{i:03d}.png": _png(i) for i in range(80)})
    ds = FolderDataset(
        s3_bucket.url("ramp"), loader=_sum_loader, storage_options=s3_bucket.storage_options, lookahead=1000
    )
    for _ in range(2):  # each epoch starts again from two batches ahead
        it = iter(ds.dataloader(batch_size=4, shuffle=True, num_workers=0))
        staged = []
        for _ in range(4):
            next(it)
            stager = ds._proc.lookahead.stager  # type: ignore[union-attr]
            assert stager is not None
            staged.append(len(stager))
        # 2, 4, 8, 16 batches of 4 ahead, less the batch just taken from what was staged
        assert staged == [8, 16, 32, 64]
        list(it)
        assert len(stager) == 0


def test_cached_epoch_reads_nothing_from_the_bucket(s3_bucket: Any, s3_proxy: Any, tmp_path: Any) -> None:
    s3_bucket.put_many({f"w/c{i % 2}/{i}.png": _png(i) for i in range(12)})
    ds = FolderDataset(
        s3_bucket.url("w"),
        loader=_sum_loader,
        storage_options=s3_proxy.storage_options,
        cache=BlobCache(str(tmp_path / "cache"), size_limit="10MB"),
    )
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2)
    first = sorted(int(s) for sums, _ in loader for s in sums)
    s3_proxy.reset_counts()
    second = sorted(int(s) for sums, _ in loader for s in sums)
    assert first == second
    assert [r for r in s3_proxy.requests if r[0] == "GET"] == []


def test_repr_hides_secrets(s3_bucket: Any) -> None:
    s3_bucket.put("p/c/1.png", _png(1))
    ds = FolderDataset(s3_bucket.url("p"), storage_options=s3_bucket.storage_options)
    secret = s3_bucket.storage_options["secret"]
    assert secret not in repr(ds)
    assert s3_bucket.url("p") in repr(ds)


def test_persistent_workers_follow_each_new_epoch_without_wasted_requests(
    s3_bucket: Any, s3_proxy: Any
) -> None:
    objects = {f"pe/c{i % 3}/{i:03d}.png": _png(i) for i in range(48)}
    s3_bucket.put_many(objects)
    ds = FolderDataset(s3_bucket.url("pe"), loader=_sum_loader, storage_options=s3_proxy.storage_options)
    loader = ds.dataloader(
        batch_size=4,
        shuffle=True,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(5),
    )
    want = sorted(int(np.frombuffer(v, np.uint8).sum()) for v in objects.values())
    s3_proxy.reset_counts()
    orders = []
    for epoch in range(2):
        # The first epoch announces the second's order (staged across the boundary); the last one
        # announces none, so that nothing is fetched for an epoch that never comes.
        loader._planner.across_epochs = epoch == 0
        sums = [int(s) for batch, _ in loader for s in batch]
        assert sorted(sums) == want
        orders.append(sums)
    assert orders[0] != orders[1]  # a new permutation, which the workers' look-ahead had to pick up
    gets = [path for method, path in s3_proxy.requests if method == "GET" and "list-type" not in path]
    # every object exactly once per epoch: nothing staged for a stale order was fetched in vain
    assert len(gets) == 2 * len(objects)

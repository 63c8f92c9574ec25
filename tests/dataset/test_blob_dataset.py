"""BlobDataset over a folder: samples by webdataset's key rule, members decoded by extension, every member
fetched together (one GET each), workers, the cache (epoch 2: no GET), exact resume, PartitionedSampler."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from blobdata import BlobCache, BlobDataset, ConfigError, DecodeError, PartitionedSampler


def _png(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4 + i % 3, 5), (i % 256, 0, 0)).save(out, format="PNG")
    return out.getvalue()


def _npy(a: Any) -> bytes:
    out = io.BytesIO()
    np.save(out, a, allow_pickle=True)
    return out.getvalue()


def _keep(batch: list[Any]) -> list[Any]:
    return batch


def _key_and_text(sample: dict[str, Any]) -> tuple[str, str, int]:
    return sample["__key__"], sample["txt"], sample["jpg"].size[0]


def _pairs(n: int) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for i in range(n):
        out[f"d/s{i:03d}.jpg"] = _png(i)
        out[f"d/s{i:03d}.txt"] = f"caption {i}".encode()
    return out


def test_folder_samples_group_members_by_key(tmp_path: Path) -> None:
    root = tmp_path / "d"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.jpg").write_bytes(_png(1))
    (root / "a" / "x.seg.png").write_bytes(_png(2))
    (root / "a" / "x.json").write_bytes(b'{"boxes": [[1, 2, 3, 4]]}')
    (root / "a" / "x.cls").write_bytes(b"7\n")
    (root / "a" / "x.npy").write_bytes(_npy(np.arange(3)))
    (root / "a" / "x.wav").write_bytes(b"RIFF....")
    (root / "b.txt").write_bytes("héllo".encode())
    (root / "README").write_bytes(b"no extension: no sample")
    ds = BlobDataset(root)
    assert len(ds) == 2 and ds.keys() == ["a/x", "b"]  # sorted by key
    s = ds[0]
    assert s["__key__"] == "a/x" and s["__url__"] == f"file://{root}/a/x"
    assert set(s) == {"__key__", "__url__", "jpg", "seg.png", "json", "cls", "npy", "wav"}
    assert isinstance(s["jpg"], Image.Image) and s["jpg"].mode == "RGB"
    assert isinstance(s["seg.png"], Image.Image)
    assert s["json"] == {"boxes": [[1, 2, 3, 4]]} and s["cls"] == 7 and s["wav"] == b"RIFF...."
    assert s["npy"].tolist() == [0, 1, 2]
    assert ds[1] == {"__key__": "b", "__url__": f"file://{root}/b", "txt": "héllo"}
    # decoders= adds or replaces one; False leaves bytes
    wav = BlobDataset(root, decoders={"wav": len, "json": None})[0]
    assert wav["wav"] == 8 and wav["json"] == b'{"boxes": [[1, 2, 3, 4]]}'
    raw = BlobDataset(root, decoders=False)[0]
    assert all(isinstance(raw[k], bytes) for k in ("jpg", "json", "cls", "npy"))
    with pytest.raises(ConfigError, match="without the dot"):
        BlobDataset(root, decoders={".wav": len})


def test_npy_is_never_unpickled_and_errors_name_the_object(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.npy").write_bytes(_npy(np.array([{"a": 1}], dtype=object)))
    (tmp_path / "d" / "y.jpg").write_bytes(b"not an image")
    ds = BlobDataset(tmp_path / "d")
    with pytest.raises(DecodeError, match=r"x\.npy.*pickle|pickle.*x\.npy"):
        ds[0]
    with pytest.raises(DecodeError, match=r"y\.jpg"):
        ds[1]
    skipped = BlobDataset(tmp_path / "d", on_error="skip")
    assert skipped.__getitems__([0, 1]) == [] and len(skipped.errors) == 2


@pytest.mark.parametrize(("workers", "method"), [(0, None), (2, "fork")])
def test_pairs_on_s3_one_get_per_member_then_all_from_the_cache(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, workers: int, method: str | None
) -> None:
    s3_bucket.put_many(_pairs(20))
    ds = BlobDataset(
        s3_bucket.url("d"),
        transform=_key_and_text,
        storage_options=s3_proxy.storage_options,
        cache=BlobCache(str(tmp_path / "cache"), size_limit="10MB"),
    )
    assert len(ds) == 20
    loader = ds.dataloader(
        batch_size=4, shuffle=True, num_workers=workers, multiprocessing_context=method, collate_fn=_keep
    )
    s3_proxy.reset_counts()
    got = [s for batch in loader for s in batch]
    assert sorted(got) == [(f"s{i:03d}", f"caption {i}", 4 + i % 3) for i in range(20)]
    gets = [p for m, p in s3_proxy.requests if m == "GET"]
    assert len(gets) == 40 == loader.stats().gets  # one GET per member, nothing listed again
    assert loader.stats().samples_from_bucket == 40  # counted per object
    cache = BlobCache(str(tmp_path / "cache"), size_limit="10MB")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and cache.info()["entries"] < 40:  # written off the hot path
        time.sleep(0.05)
    s3_proxy.reset_counts()
    assert sorted(s for batch in loader for s in batch) == sorted(got)
    assert [m for m, _ in s3_proxy.requests if m == "GET"] == []  # epoch 2: all from the cache
    s = loader.stats()
    assert s.gets == 40 and s.samples_from_cache == 40 and s.samples == 40


def _ten_plus_cls(s: dict[str, Any]) -> int:
    return int(s["txt"]) * 10 + s["cls"]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_and_partitioned_sampler(tmp_path: Path, workers: int) -> None:
    root = tmp_path / "d"
    root.mkdir()
    for i in range(24):
        (root / f"{i:02d}.txt").write_bytes(str(i).encode())
        (root / f"{i:02d}.cls").write_bytes(str(i % 3).encode())
    ds = BlobDataset(root, transform=_ten_plus_cls, lookahead=8)

    def loader() -> Any:
        return ds.dataloader(batch_size=4, shuffle=True, generator=_gen(1), num_workers=workers)

    whole = [b.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == whole
    part = ds.dataloader(batch_size=5, sampler=PartitionedSampler(ds, num_replicas=1, rank=0, seed=2))
    seen = sorted(x for b in part for x in b.tolist())
    assert seen == sorted(i * 10 + i % 3 for i in range(24))


def _gen(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def test_bad_folders(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no sample"):
        BlobDataset(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nothing found"):
        BlobDataset(tmp_path / "absent")


def test_the_listing_is_remembered(s3_bucket: Any, s3_proxy: Any) -> None:
    s3_bucket.put_many(_pairs(3))
    first = BlobDataset(s3_bucket.url("d"), storage_options=s3_proxy.storage_options)
    assert any("?" in p for _, p in s3_proxy.requests)  # listed once
    s3_proxy.reset_counts()
    again = BlobDataset(s3_bucket.url("d"), storage_options=s3_proxy.storage_options)
    assert s3_proxy.requests == [] and again.keys() == first.keys() == ["s000", "s001", "s002"]
    BlobDataset(s3_bucket.url("d"), storage_options=s3_proxy.storage_options, refresh=True)
    assert any("?" in p for _, p in s3_proxy.requests)


def test_a_saved_listing_is_used_instead_of_listing(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    s3_bucket.put_many(_pairs(2))
    first = BlobDataset(s3_bucket.url("d"), storage_options=s3_proxy.storage_options, share_listing=False)
    assert first.manifest is not None and len(first.manifest) == 4
    first.manifest.save(tmp_path / "listing.manifest")
    s3_proxy.reset_counts()
    other = BlobDataset(
        s3_bucket.url("d"), manifest=tmp_path / "listing.manifest", storage_options=s3_proxy.storage_options
    )
    assert s3_proxy.requests == [] and other.keys() == ["s000", "s001"]


def _layout(tmp_path: Path, layout: str) -> BlobDataset:
    root = tmp_path / "d"
    root.mkdir()
    rows = []
    for i in range(20):
        (root / f"{i:02d}.txt").write_bytes(str(i).encode())
        (root / f"{i:02d}.cls").write_bytes(str(i % 3).encode())
        rows.append(i)
    if layout == "metadata":
        (root / "metadata.jsonl").write_text(
            "".join(
                json.dumps({"file_name": f"{i:02d}.txt", "cls_file_name": f"{i:02d}.cls"}) + "\n"
                for i in rows
            )
        )
        return BlobDataset(root, transform=_ten_plus_cls, lookahead=8)
    if layout == "index":
        (tmp_path / "index.csv").write_text("key\n" + "".join(f"{i:02d}.txt\n{i:02d}.cls\n" for i in rows))
        return BlobDataset(root, index=tmp_path / "index.csv", transform=_ten_plus_cls, lookahead=8)
    return BlobDataset(root, transform=_ten_plus_cls, lookahead=8)


@pytest.mark.parametrize("layout", ["folder", "metadata", "index"])
def test_every_layout_resumes_exactly_and_partitions(tmp_path: Path, layout: str) -> None:
    ds = _layout(tmp_path, layout)
    want = [i * 10 + i % 3 for i in range(20)]
    assert sorted(ds[i] for i in range(len(ds))) == want

    def loader() -> Any:
        return ds.dataloader(batch_size=3, shuffle=True, generator=_gen(7), num_workers=2)

    whole = [b.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == whole
    shares = []
    for rank in (0, 1):  # two nodes of one rank each
        sampler = PartitionedSampler(ds, num_replicas=2, rank=rank, seed=1, nproc_per_node=1)
        shares.append(sorted(x for b in ds.dataloader(batch_size=4, sampler=sampler) for x in b.tolist()))
    assert sorted(shares[0] + shares[1]) == want and not set(shares[0]) & set(shares[1])


def _caption(rest: dict[str, Any]) -> int:
    return len(rest["txt"])


@pytest.mark.parametrize("workers", [0, 2])
def test_device_path_takes_the_image_member(tmp_path: Path, workers: int) -> None:
    from blobdata import gpu

    root = tmp_path / "d"
    root.mkdir()
    for i in range(8):
        out = io.BytesIO()
        Image.new("RGB", (20 + i, 16), (i * 20, 50, 0)).save(out, format="JPEG")
        (root / f"{i}.jpg").write_bytes(out.getvalue())
        (root / f"{i}.txt").write_text("x" * i)
    ds = BlobDataset(root, transform=_caption)
    loader = ds.dataloader(
        batch_size=4,
        num_workers=workers,
        device="cpu",
        gpu_transform=gpu.TrainTransform(8, channels_last=False),
    )
    got: list[int] = []
    for images, targets in loader:
        assert images.shape[1:] == (3, 8, 8) and images.device.type == "cpu"
        got += targets.tolist()  # the rest of each dict, through transform, collated
    assert sorted(got) == list(range(8))
    (root / "8.jpg").write_bytes(_png(1))
    (root / "8.png").write_bytes(_png(2))
    (root / "8.txt").write_text("two images")
    two = BlobDataset(root, transform=_caption)
    with pytest.raises(DecodeError, match=r"8 has 2 image members \(jpg, png\)"):
        list(two.dataloader(batch_size=9, device="cpu", gpu_transform=gpu.TrainTransform(8)))

"""The conventions' owners, run on a tree as the oracle of BlobDataset's layouts: Hugging Face's
``imagefolder`` loader (``datasets``, offline, its cache in a temporary folder) and webdataset's grouping
of a tar's files into samples. Also ``typed``, which spells out every value's type so that a comparison
tells 1 from 1.0 and True from 1."""

from __future__ import annotations

import gc
import io
import math
import os
import tarfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from blobdata import BlobDataset

__all__ = ["blob_fields", "hugging_face", "put_tree", "typed", "webdataset_samples", "write_tree"]


def typed(value: Any) -> Any:
    """``value`` with its type spelled out at every level (NaN equal to itself)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [typed(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def write_tree(root: Path, tree: Mapping[str, bytes]) -> Path:
    """The objects ``tree`` (key relative to ``root`` -> bytes) as files below ``root``."""
    for rel, data in tree.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def put_tree(bucket: Any, prefix: str, tree: Mapping[str, bytes]) -> str:
    """The objects ``tree`` below ``prefix`` of a test bucket; the URL of ``prefix``."""
    bucket.put_many({f"{prefix}/{rel}": data for rel, data in tree.items()})
    return str(bucket.url(prefix))


def hugging_face(root: Path, cache: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Hugging Face's ``load_dataset("imagefolder", data_dir=root)``, its rows with each image column as
    its path relative to ``root`` (images not decoded), in its order."""
    datasets = pytest.importorskip("datasets")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local folder: nothing to fetch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        # Its CSV reader leaves pandas' file open (ResourceWarning when collected): collected here.
        warnings.simplefilter("ignore", ResourceWarning)
        ds = datasets.load_dataset(
            "imagefolder", data_dir=str(root), split="train", cache_dir=str(cache), **kwargs
        )
        gc.collect()
    images = [name for name, f in ds.features.items() if _is_image(f, datasets)]
    for name in images:
        feature = ds.features[name]
        undecoded = (
            datasets.Image(decode=False)
            if isinstance(feature, datasets.Image)
            else datasets.List(datasets.Image(decode=False))
        )
        ds = ds.cast_column(name, undecoded)
    prefix = str(root) + os.sep

    def rel(v: Any) -> str | None:
        return v["path"][len(prefix) :] if v is not None else None

    out = []
    for row in ds:
        for name in images:
            value = row[name]
            row[name] = [rel(v) for v in value] if isinstance(value, list) else rel(value)
        out.append(row)
    return out


def _is_image(feature: Any, datasets: Any) -> bool:
    if isinstance(feature, datasets.Image):
        return True
    return isinstance(feature, datasets.List) and isinstance(feature.feature, datasets.Image)


def blob_fields(ds: BlobDataset, i: int) -> tuple[list[str], dict[str, Any]]:
    """Sample ``i`` of ``ds`` as the oracle compares it: its objects (keys relative to the root, in
    member order) and its fields (what is neither a member nor ``__key__``/``__url__``)."""
    t = ds.table
    rows = list(t.members(i))
    members = {t.name(j).removesuffix("[]") for j in rows}
    fields = t.fields(i)
    assert not members & set(fields), (members, fields)
    return [t.relkey(j) for j in rows], fields


def webdataset_samples(tree: Mapping[str, bytes], tmp: Path) -> list[dict[str, Any]]:
    """webdataset's samples of a tar of ``tree`` (its files in the order ``tree`` gives), grouped by its
    own key rule (``base_plus_ext``, suffixes lower-cased)."""
    wds = pytest.importorskip("webdataset.tariterators")
    path = tmp / "shard.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in tree.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with path.open("rb") as fh:
        return list(wds.group_by_keys(wds.tar_file_expander([{"stream": fh, "url": str(path)}])))

"""Debris folders (macOS's ``__MACOSX/``, Jupyter's ``.ipynb_checkpoints/``, any hidden or ``__`` folder),
local and on the S3 server: FolderDataset keeps torchvision's contract (they are classes) with a warning
naming each and the option that skips them, ``skip_hidden=True`` gives Hugging Face's classes, and
BlobDataset's listing skips them as Hugging Face's loader does."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from blobdata import BlobDataset, EmptyDatasetError, FolderDataset
from tests.support.owners import hugging_face, put_tree, write_tree


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (i, 0, 0)).save(out, format="JPEG")
    return out.getvalue()


def _tree() -> dict[str, bytes]:
    tree = {f"{c}/{i}.jpg": _jpeg(i) for c in ("cat", "dog") for i in range(3)}
    tree.update(
        {f"__MACOSX/{c}/._{i}.jpg": b"\x00\x05\x16\x07AppleDouble" for c in ("cat", "dog") for i in range(3)}
    )
    tree[".ipynb_checkpoints/look-checkpoint.ipynb"] = b"{}"
    return tree


def _places(tmp_path: Path, s3_bucket: Any, tree: dict[str, bytes]) -> tuple[Path, list[tuple[str, Any]]]:
    root = write_tree(tmp_path / "tree", tree)
    return root, [(str(root), None), (put_tree(s3_bucket, "tree", tree), s3_bucket.storage_options)]


def test_folder_dataset_keeps_torchvisions_classes_and_warns(tmp_path: Path, s3_bucket: Any) -> None:
    root, places = _places(tmp_path, s3_bucket, _tree())
    torchvision = sorted(e.name for e in os.scandir(root) if e.is_dir())  # torchvision's find_classes
    assert torchvision == [".ipynb_checkpoints", "__MACOSX", "cat", "dog"]
    for url, opts in places:
        with pytest.raises(EmptyDatasetError) as info:  # as torchvision: an empty class is an error
            FolderDataset(url, storage_options=opts)
        said = str(info.value)
        assert ".ipynb_checkpoints" in said and "skip_hidden=True" in said and "allow_empty=True" in said
        with pytest.warns(UserWarning) as warned:
            ds = FolderDataset(url, storage_options=opts, allow_empty=True)
        assert ds.classes == torchvision
        said = sorted(str(w.message) for w in warned)
        assert len(said) == 2 and all("pass skip_hidden=True" in s for s in said)
        assert "class folder '.ipynb_checkpoints'" in said[0] and "is class 0 of 4" in said[0]
        assert "class folder '__MACOSX'" in said[1] and "is class 1 of 4" in said[1]


def test_skip_hidden_gives_hugging_faces_classes(tmp_path: Path, s3_bucket: Any) -> None:
    root, places = _places(tmp_path, s3_bucket, _tree())
    theirs = hugging_face(root, tmp_path / "hf")
    names = sorted({r["image"].split("/")[0] for r in theirs})
    assert names == ["cat", "dog"]  # Hugging Face skips both folders
    by_path = {r["image"]: names[r["label"]] for r in theirs}
    for url, opts in places:
        ds = FolderDataset(url, storage_options=opts, skip_hidden=True)  # no warning (they are errors here)
        assert ds.classes == names and len(ds) == len(theirs)
        prefix = str(root) + os.sep if "://" not in url else url + "/"
        assert {p[len(prefix) :]: ds.classes[t] for p, t in ds.samples} == by_path
        assert [t for _, t in ds] == ds.targets == [0, 0, 0, 1, 1, 1]
        assert (
            FolderDataset(url, storage_options=opts, skip_hidden=True, manifest=_saved(ds, tmp_path)).classes
            == names
        )


def _saved(ds: FolderDataset, tmp_path: Path) -> Path:
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.manifest"
    ds.manifest.save(path)
    return path


def test_skip_hidden_with_no_class_left(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "t", {"__MACOSX/a/._x.jpg": b"x", ".git/objects/y.jpg": b"y"})
    with pytest.raises(EmptyDatasetError, match=r"hidden or special ones \(\.git, __MACOSX\)"):
        FolderDataset(root, skip_hidden=True)


def test_blob_dataset_listing_skips_what_hugging_face_skips(tmp_path: Path, s3_bucket: Any) -> None:
    tree = _tree() | {"top/.cache/z.jpg": _jpeg(9), "top/__pycache__/w.jpg": _jpeg(8), "top/ok.jpg": _jpeg(7)}
    root, places = _places(tmp_path, s3_bucket, tree)
    theirs = sorted(r["image"] for r in hugging_face(root, tmp_path / "hf", drop_labels=True))
    assert theirs == sorted(
        k for k in tree if k.endswith(".jpg") and not k.startswith(("__", "top/.", "top/__"))
    )
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts)
        assert sorted(ds.table.relkey(j) for j in range(ds.table.num_objects)) == theirs
    index = tmp_path / "index.csv"  # an index names its objects: none is skipped
    index.write_text("key\ntop/.cache/z.jpg\ncat/0.jpg\n")
    assert BlobDataset(root, index=index).keys() == ["cat/0", "top/.cache/z"]


def test_blob_dataset_of_hidden_folders_only(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "t", {".ipynb_checkpoints/a-checkpoint.ipynb": b"{}"})
    with pytest.raises(EmptyDatasetError, match=r"all lie in hidden or special folders \(e\.g\. file://"):
        BlobDataset(root)

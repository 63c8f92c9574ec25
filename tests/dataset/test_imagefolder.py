"""torchvision's DatasetFolder/ImageFolder contract as its users rely on it (issue 22): is_valid_file
and loader get paths, samples/targets/imgs can be assigned, find_classes/make_dataset overrides are
honoured, root is what was given. torchvision cannot be installed next to this CPU torch, so the
reference here is its documented behaviour (torchvision/datasets/folder.py), written out."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from blobdata import ConfigError, EmptyDatasetError, FolderDataset
from blobdata._listing import IMG_EXTENSIONS


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """17 images in 3 classes (one nested, one with an upper-case suffix) and a text file."""
    root = tmp_path / "train"
    names = [f"a/{i}.png" for i in range(6)] + [f"b/{i}.png" for i in range(5)] + ["b/sub/x.PNG"]
    names += [f"c/{i}.png" for i in range(5)]
    for k, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(_png(k))
    (root / "a" / "notes.txt").write_bytes(b"text")
    return root


# -- torchvision's documented behaviour -------------------------------------------------------------


def tv_find_classes(directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    return classes, {c: i for i, c in enumerate(classes)}


def tv_make_dataset(
    directory: str | os.PathLike[str],
    class_to_idx: dict[str, int],
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
) -> list[tuple[str, int]]:
    directory = os.path.expanduser(directory)
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    valid = is_valid_file or (lambda p: p.lower().endswith(extensions))  # type: ignore[arg-type]
    out = []
    for cls in sorted(class_to_idx):
        target_dir = os.path.join(directory, cls)
        if not os.path.isdir(target_dir):
            continue
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if valid(path):
                    out.append((path, class_to_idx[cls]))
    return out


def tv_image_folder(root: Any, is_valid_file: Callable[[str], bool] | None = None) -> list[tuple[str, int]]:
    _, class_to_idx = tv_find_classes(root)
    return tv_make_dataset(root, class_to_idx, None if is_valid_file else IMG_EXTENSIONS, is_valid_file)


def verifies(path: str) -> bool:
    """The usual corrupt-image filter: it opens the file by its path."""
    try:
        with Image.open(path) as im:
            im.verify()
        return True
    except Exception:
        return False


def _pixels(ds: FolderDataset, i: int) -> bytes:
    return bytes(np.asarray(ds[i][0]).tobytes())


# -- 8, 9: paths, as ImageFolder gives them ----------------------------------------------------------


def test_is_valid_file_gets_local_paths(tree: Path) -> None:
    """Before: file:// URLs, so a filter that opens the file kept 0 of 17 samples."""
    (tree / "c" / "broken.png").write_bytes(b"\x89PNG not really")
    ds = FolderDataset(str(tree), is_valid_file=verifies)
    assert len(ds) == 17
    assert list(ds.samples) == tv_image_folder(str(tree), is_valid_file=verifies)


def test_the_loader_gets_a_path(tree: Path) -> None:
    """Before: str(path) was '<blobdata._decode.ObjectFile object at ...>' and path.lower() raised."""
    seen: list[tuple[str, str, bool]] = []

    def loader(path: Any) -> str:  # how cv2-style and extension-checking loaders use it
        assert path.lower().endswith(".png")
        with open(str(path), "rb") as fh:
            head = fh.read(8)
        seen.append((str(path), os.fspath(path), head == b"\x89PNG\r\n\x1a\n"))
        return str(path)

    ds = FolderDataset(str(tree), loader=loader)
    for i in range(len(ds)):
        assert ds[i][0] == ds.samples[i][0]  # the file itself, as in samples
    assert all(s == f and ok for s, f, ok in seen) and len(seen) == 17


@pytest.mark.network
def test_the_loader_gets_a_path_for_a_bucket_object(s3_bucket: Any) -> None:
    s3_bucket.put_many({"train/a/1.png": _png(1), "train/b/2.png": _png(2)})
    kept: list[str] = []

    def loader(path: Any) -> bytes:
        kept.append(str(path))
        assert str(path).endswith(".png") and path.endswith(".png") and os.fspath(path) == str(path)
        with open(str(path), "rb") as fh:  # a private temporary copy of the object
            return fh.read()

    ds = FolderDataset(s3_bucket.url("train"), storage_options=s3_bucket.storage_options, loader=loader)
    assert [ds[i][0] for i in range(2)] == [_png(1), _png(2)]
    assert ds.samples[0][0] == s3_bucket.url("train/a/1.png")  # URLs for a bucket, as before
    assert kept and not any(os.path.exists(p) for p in kept)  # removed once the loader returned


# -- 10: samples, targets, imgs ------------------------------------------------------------------------


def test_targets_is_a_list_equal_to_imagefolders(tree: Path) -> None:
    ds = FolderDataset(tree)
    reference = tv_image_folder(tree)
    assert isinstance(ds.targets, list) and ds.targets == [t for _, t in reference]
    assert ds.samples == reference and ds.imgs == reference


def test_samples_can_be_assigned_to_take_a_subset_or_relabel(tree: Path) -> None:
    """Before: AttributeError (samples, targets and imgs were read-only properties)."""
    ds = FolderDataset(tree)
    whole = list(ds.samples)
    pixels = {p: _pixels(ds, i) for i, (p, _) in enumerate(whole)}
    subset = [(p, 1 - t if t < 2 else t) for p, t in whole if not p.endswith("0.png")]
    ds.samples = subset
    assert len(ds) == len(subset) == 14 and list(ds.samples) == subset
    assert ds.targets == [t for _, t in subset]  # follows samples
    assert [ds[i][1] for i in range(len(ds))] == [t for _, t in subset]  # loaded with the new labels
    assert all(_pixels(ds, i) == pixels[p] for i, (p, _) in enumerate(subset))
    light = FolderDataset(tree, loader=lambda f: len(f.read()))
    light.samples = subset
    batch = next(iter(light.dataloader(batch_size=14, num_workers=1)))  # workers read the subset too
    assert batch[1].tolist() == [t for _, t in subset]
    assert batch[0].tolist() == [os.path.getsize(p) for p, _ in subset]
    # targets and imgs are attributes, as in ImageFolder: assigning them does not change what is loaded
    ds.targets = [0] * len(ds)
    ds.imgs = subset[:2]
    assert ds.targets == [0] * 14 and ds.imgs == subset[:2] and ds[0][1] == subset[0][1]
    with pytest.raises(ConfigError, match=r"missing\.png"):
        ds.samples = [(str(tree / "a" / "missing.png"), 0)]


# -- 11: find_classes and make_dataset overrides -------------------------------------------------------


class TwoClasses(FolderDataset):
    """Picks and merges classes, a common override: a and c become class 0, b is left out."""

    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes, _ = super().find_classes(directory)
        assert classes == ["a", "b", "c"]
        return ["a+c"], {"a": 0, "c": 0}


class OddNames(FolderDataset):
    @staticmethod
    def make_dataset(
        directory: Any,
        class_to_idx: dict[str, int],
        extensions: Any = None,
        is_valid_file: Any = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        everything = FolderDataset.make_dataset(directory, class_to_idx, is_valid_file=lambda p: True)
        return [(p, t) for p, t in everything if Path(p).stem in ("1", "3", "notes")]


def test_a_find_classes_override_is_honoured(tree: Path) -> None:
    """Before: silently ignored."""
    ds = TwoClasses(str(tree))
    _, all_classes = tv_find_classes(tree)
    want = [(p, 0) for p, _ in tv_make_dataset(str(tree), {"a": 0, "c": 0}, IMG_EXTENSIONS)]
    assert ds.classes == ["a+c"] and ds.class_to_idx == {"a": 0, "c": 0} and len(all_classes) == 3
    assert list(ds.samples) == want and len(ds) == 11
    assert {ds[i][1] for i in range(len(ds))} == {0}


def test_a_make_dataset_override_is_honoured(tree: Path) -> None:
    ds = OddNames(str(tree), loader=lambda f: f.read())
    _, class_to_idx = tv_find_classes(tree)
    everything = tv_make_dataset(str(tree), class_to_idx, is_valid_file=lambda p: True)
    want = [(p, t) for p, t in everything if Path(p).stem in ("1", "3", "notes")]
    assert list(ds.samples) == want and len(ds) == 7  # notes.txt too: the override chose it
    assert ds[len(ds) - 1][0] == (Path(want[-1][0])).read_bytes()


# -- 12: root as given -----------------------------------------------------------------------------------


def test_root_is_what_was_given(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: always the canonical file:// URL."""
    assert FolderDataset(tree).root == tree  # a Path stays a Path, as in VisionDataset
    assert FolderDataset(str(tree)).root == str(tree)
    monkeypatch.setenv("HOME", str(tree.parent))
    home = FolderDataset("~/train")
    assert home.root == str(tree) and home.url == "file://" + str(tree)  # expanded, as VisionDataset does
    monkeypatch.chdir(tree.parent)
    rel = FolderDataset("train")
    assert rel.root == "train" and rel.samples[0][0] == os.path.join("train", "a", "0.png")
    assert list(rel.samples) == tv_image_folder("train")


# -- 14: extensions ----------------------------------------------------------------------------------------


def test_extensions_match_as_torchvision_matches(tree: Path) -> None:
    """torchvision lower-cases the file name, not the extensions. Before, ".PNG" matched x.PNG."""
    ds = FolderDataset(tree, extensions=(".png",))
    assert str(tree / "b" / "sub" / "x.PNG") in [p for p, _ in ds.samples]
    with pytest.raises(EmptyDatasetError):
        FolderDataset(tree, extensions=(".PNG",))
    _, class_to_idx = tv_find_classes(tree)
    assert tv_make_dataset(tree, class_to_idx, (".PNG",)) == []

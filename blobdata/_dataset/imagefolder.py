"""torchvision's ``DatasetFolder``/``ImageFolder`` contract, on top of a listing.

What :class:`~blobdata.FolderDataset` exposes as ImageFolder does: ``samples`` (``(path, class_index)``,
a local path for a local folder, the URL for a bucket), ``targets`` (a list), ``imgs``, all three
assignable; ``find_classes(directory)`` and ``make_dataset(directory, class_to_idx, extensions,
is_valid_file, allow_empty)`` that a subclass may override, and which are honoured. The listing stays
a :class:`~blobdata._listing.manifest.Manifest` of numpy arrays: ``samples`` is a view built on access, and
taking a subset (assigning ``samples``, or a ``make_dataset`` override) selects rows of it.
"""

from __future__ import annotations

import contextvars
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, EmptyDatasetError
from .._listing import Manifest
from .._url import parse_url

__all__ = [
    "Building",
    "ImageFolderContract",
    "Samples",
    "apply_overrides",
    "building",
    "default_find_classes",
    "default_make_dataset",
    "every",
    "hidden_classes",
    "is_hidden_class",
    "of_classes",
    "select",
    "subset_by_paths",
]


class Building(NamedTuple):
    """The dataset being made: what a default ``make_dataset``/``find_classes`` called from a
    subclass's override reads instead of listing the folder again."""

    url: str
    manifest: Manifest  # every object below a class folder when make_dataset is overridden
    local_root: str | None


building: contextvars.ContextVar[Building | None] = contextvars.ContextVar("blobdata_building", default=None)


def path_prefix(manifest: Manifest, local_root: str | None) -> str:
    """What ``samples`` paths start with: the local root as given (joined as ImageFolder joins), or
    the root URL."""
    if local_root is None:
        return manifest.root + "/"
    return local_root if local_root.endswith(os.sep) else local_root + os.sep


class Samples(Sequence[tuple[str, int]]):
    """``samples`` as ImageFolder has it, ``(path_or_url, class_index)``, built on access."""

    def __init__(self, manifest: Manifest, targets: npt.NDArray[Any], local_root: str | None) -> None:
        self._m = manifest
        self._t = targets
        self._prefix = path_prefix(manifest, local_root)

    def __len__(self) -> int:
        return len(self._m)

    @overload
    def __getitem__(self, i: int) -> tuple[str, int]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[str, int]]: ...
    def __getitem__(self, i: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return (self._prefix + self._m.relkey(i), int(self._t[i]))

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:  # == ImageFolder's list of tuples
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != len(self):
            return False
        return all(tuple(a) == tuple(b) for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"[{head}{', ...' if len(self) > 3 else ''}] ({len(self)} samples)"


def select(manifest: Manifest, rows: npt.ArrayLike) -> Manifest:
    """The manifest of the samples ``rows`` of ``manifest`` (in that order; repeats allowed)."""
    idx = np.ascontiguousarray(rows, dtype=np.int64)
    n = len(manifest)
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"sample index out of range for {n} samples of {manifest.root}")
    arrays = manifest._arrays()

    def gather(buf: npt.NDArray[Any], offs: npt.NDArray[np.int64]) -> tuple[Any, Any]:
        starts, lengths = offs[idx], offs[idx + 1] - offs[idx]
        new_offs = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=new_offs[1:])
        pos = np.repeat(starts - new_offs[:-1], lengths) + np.arange(int(new_offs[-1]), dtype=np.int64)
        return buf[pos], new_offs

    keys, key_offsets = gather(arrays["keys"], arrays["key_offsets"])
    ids, id_offsets = gather(arrays["ids"], arrays["id_offsets"])
    return Manifest.from_arrays(
        manifest.root,
        manifest.classes,
        keys=keys,
        key_offsets=key_offsets,
        sizes=manifest.sizes[idx],
        targets=manifest.targets[idx],
        ids=ids,
        id_offsets=id_offsets,
        listed_at=manifest.listed_at,
        skipped=manifest.skipped,
        params=manifest.params,
    )


def subset_by_paths(
    manifest: Manifest, local_root: str | None, pairs: Iterable[Sequence[Any]], what: str
) -> tuple[Manifest, npt.NDArray[np.int64]]:
    """(rows of ``manifest`` named by ``(path_or_url, target)`` pairs, their targets). Every path must
    be one of the listing's samples: blobdata reads only listed objects (their size and identity)."""
    prefix = path_prefix(manifest, local_root)
    cut = len(prefix)
    where = {manifest.relkey(i): i for i in range(len(manifest))}
    rows: list[int] = []
    targets: list[int] = []
    for pair in pairs:
        path, target = pair[0], pair[1]
        key = os.fspath(path)
        row = where.get(key[cut:]) if key.startswith(prefix) else None
        if row is None and local_root is not None and os.path.isabs(key):  # the absolute spelling
            row = where.get(key[len(parse_url(manifest.root).prefix) + 1 :])
        if row is None:
            raise ConfigError(
                f"{what}: {key!r} is not one of the objects listed under {manifest.root} (paths must start "
                f"with {prefix!r}); to read a new object, make the dataset again (refresh=True for a bucket)",
                url=manifest.root,
            )
        rows.append(row)
        targets.append(int(target))
    return select(manifest, rows), np.asarray(targets, dtype=np.int64)


def _valid(
    extensions: str | tuple[str, ...] | None, is_valid_file: Callable[[str], bool] | None
) -> Callable[[str], bool]:
    both_none = extensions is None and is_valid_file is None
    if both_none or (extensions is not None and is_valid_file is not None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    if is_valid_file is not None:
        return is_valid_file
    exts = extensions if isinstance(extensions, str) else tuple(extensions or ())
    return lambda path: path.lower().endswith(exts)


def default_make_dataset(
    directory: str | os.PathLike[str],
    class_to_idx: Mapping[str, int],
    extensions: str | tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
) -> list[tuple[str, int]]:
    """torchvision's ``make_dataset`` over the listing: the samples of the class folders named in
    ``class_to_idx``, in ImageFolder's order, that pass ``extensions`` or ``is_valid_file``. While a
    dataset of ``directory`` is being made, its listing is used; otherwise ``directory`` is listed."""
    if class_to_idx is None:
        raise ValueError("The class_to_idx parameter cannot be None.")
    valid = _valid(extensions, is_valid_file)
    url = str(parse_url(directory))
    now = building.get()
    if now is not None and now.url == url:
        manifest, local_root = now.manifest, now.local_root
    else:
        from .._listing import list_folder

        local_root = os.fspath(directory) if parse_url(directory).protocol == "file" else None
        if local_root is not None and local_root.startswith("file://"):
            local_root = local_root[len("file://") :]
        manifest = list_folder(url, is_valid_file=lambda _p: True, allow_empty=True, local_root=local_root)
    prefix = path_prefix(manifest, local_root)
    out: list[tuple[str, int]] = []
    found: set[str] = set()
    for i in range(len(manifest)):
        folder = manifest.classes[int(manifest.targets[i])]
        if folder not in class_to_idx:
            continue
        path = prefix + manifest.relkey(i)
        if valid(path):
            out.append((path, class_to_idx[folder]))
            found.add(folder)
    empty = set(class_to_idx) - found
    if empty and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
        if extensions is not None:
            shown = extensions if isinstance(extensions, str) else ", ".join(extensions)
            msg += f"Supported extensions are: {shown}"
        raise EmptyDatasetError(msg, url=url)
    return out


def every(path: str) -> bool:
    """The listing a make_dataset override chooses from: every object below the class folders."""
    return True


def default_find_classes(
    directory: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> tuple[list[str], dict[str, int]]:
    """torchvision's ``find_classes``: the sorted class folders of ``directory`` (the listing's, while a
    dataset of it is being made) and their indices."""
    now = building.get()
    if now is not None and now.url == str(parse_url(directory)):
        classes = list(now.manifest.classes)
    else:
        from .._listing import list_folder

        listed = list_folder(os.fspath(directory), storage_options=storage_options, is_valid_file=every,
                             allow_empty=True, progress=False)  # fmt: skip
        classes = list(listed.classes)
    return classes, {c: i for i, c in enumerate(classes)}


def apply_overrides(
    ds: Any,
    own_make: bool,
    extensions: tuple[str, ...] | None,
    is_valid_file: Callable[[str], bool] | None,
    allow_empty: bool,
) -> tuple[Manifest, npt.NDArray[Any], list[str], dict[str, int]]:
    """A subclass's ``find_classes`` / ``make_dataset``, called as DatasetFolder calls them:
    (manifest, targets, classes, class_to_idx) of the dataset they describe."""
    from .._listing import IMG_EXTENSIONS

    classes, class_to_idx = ds.find_classes(ds.root)
    listed: Manifest = ds._manifest
    if own_make:
        exts = None if is_valid_file is not None else (extensions or IMG_EXTENSIONS)
        samples = ds.make_dataset(
            ds.root, class_to_idx, extensions=exts, is_valid_file=is_valid_file, allow_empty=allow_empty
        )
        manifest, targets = subset_by_paths(listed, ds._local_root, samples, "make_dataset")
        return manifest, targets, list(classes), dict(class_to_idx)
    manifest, targets = of_classes(listed, class_to_idx, allow_empty)
    return manifest, targets, list(classes), dict(class_to_idx)


def of_classes(
    listed: Manifest, class_to_idx: Mapping[str, int], allow_empty: bool
) -> tuple[Manifest, npt.NDArray[Any]]:
    """The samples of ``listed`` in the class folders ``class_to_idx`` names, and their targets by it;
    unless ``allow_empty``, EmptyDatasetError for a class with none."""
    remap = np.full(len(listed.classes), -1, dtype=np.int64)
    for folder, j in class_to_idx.items():
        if folder in listed.classes:
            remap[listed.classes.index(folder)] = j
    manifest = select(listed, np.flatnonzero(remap[listed.targets] >= 0))
    got = {listed.classes[int(t)] for t in np.unique(manifest.targets)}
    empty = sorted(set(class_to_idx) - got)
    if empty and not allow_empty:
        raise EmptyDatasetError(
            f"Found no valid file for the classes {', '.join(empty)} under {listed.root}.", url=listed.root
        )
    return manifest, remap[manifest.targets]


def is_hidden_class(name: str) -> bool:
    """A hidden (``.ipynb_checkpoints``) or special (``__MACOSX``) folder: one Hugging Face skips."""
    return name.startswith((".", "__"))


def hidden_classes(listed: Manifest, url: str, skip: bool, allow_empty: bool) -> Manifest | None:
    """With ``skip`` (``skip_hidden=True``): the listing without its hidden and special class folders
    (None when it has none). Without: None, after a warning naming each such folder, which torchvision
    makes a class as blobdata does (a ``__MACOSX`` left by unzipping on a Mac shifts every label)."""
    hidden = [c for c in listed.classes if is_hidden_class(c)]
    if not skip:
        for c in hidden:
            warnings.warn(
                f"class folder {c!r} of {url} is a hidden or special folder (as macOS's __MACOSX or "
                f"Jupyter's .ipynb_checkpoints are): it is class {listed.classes.index(c)} of "
                f"{len(listed.classes)}, as in torchvision's ImageFolder, and shifts the labels of the "
                "classes after it; pass skip_hidden=True to skip folders whose name starts with '.' or "
                "'__', as Hugging Face does",
                UserWarning,
                stacklevel=3,
            )
        return None
    if not hidden:
        empty = [c for c, n in zip(listed.classes, listed.class_counts(), strict=True) if n == 0]
        if empty and not allow_empty:
            raise EmptyDatasetError(
                f"Found no valid file for the classes {', '.join(sorted(empty))} under {listed.root}. Pass "
                "allow_empty=True to accept empty classes.",
                url=listed.root,
            )
        return None
    kept = [c for c in listed.classes if not is_hidden_class(c)]
    if not kept:
        raise EmptyDatasetError(
            f"Couldn't find any class folder in {url} but hidden or special ones ({', '.join(hidden)}), "
            "which skip_hidden=True skips",
            url=url,
        )
    manifest, targets = of_classes(listed, {c: i for i, c in enumerate(kept)}, allow_empty)
    arrays = {**manifest._arrays(), "targets": targets}
    at, skipped, params = listed.listed_at, listed.skipped, listed.params
    return Manifest.from_arrays(manifest.root, kept, **arrays, listed_at=at, skipped=skipped, params=params)


class ImageFolderContract:
    """The part of :class:`~blobdata.FolderDataset` that is ImageFolder's: see the module docstring."""

    _manifest: Manifest
    _targets: npt.NDArray[Any]
    _local_root: str | None
    _url: str
    _storage_options: dict[str, Any]
    _targets_list: list[Any] | None
    _imgs: Any

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        """torchvision's ``find_classes``: the sorted class folders of ``directory`` and their indices.
        A subclass may override it (to pick or merge classes); the dataset then uses what it returns."""
        from .._stores import resolve_storage_options

        opts = resolve_storage_options(parse_url(directory).protocol, self._storage_options)
        return default_find_classes(directory, opts)

    make_dataset = staticmethod(default_make_dataset)

    @property
    def url(self) -> str:
        """The root's canonical URL (``file:///...`` for a local folder)."""
        return self._url

    @property
    def samples(self) -> Sequence[tuple[str, int]]:
        """``(path, class_index)`` per sample (a local path for a local folder, the URL for a bucket),
        built on access. Assign a list of such pairs (of listed objects) to take a subset or relabel:
        the dataset then reads those, as ImageFolder does."""
        return Samples(self._manifest, self._targets, self._local_root)

    @samples.setter
    def samples(self, value: Sequence[Sequence[Any]]) -> None:
        self._manifest, self._targets = subset_by_paths(self._manifest, self._local_root, value, "samples")
        self._targets_list = None

    @property
    def imgs(self) -> Any:
        """``samples``, as in ImageFolder; assigning it (as there) changes what ``imgs`` says only."""
        return self.samples if self._imgs is None else self._imgs

    @imgs.setter
    def imgs(self, value: Any) -> None:
        self._imgs = value

    @property
    def targets(self) -> list[Any]:
        """The class index of each sample, a list (made on first use). As in ImageFolder, assigning it
        does not change what is loaded (``samples`` does); after ``samples`` is assigned it follows it."""
        if self._targets_list is None:
            self._targets_list = self._targets.tolist()
        return self._targets_list

    @targets.setter
    def targets(self, value: Sequence[Any]) -> None:
        self._targets_list = list(value)

"""Local class folders whose samples load as their own number, so that what a loader yields is the
sampler's indices themselves: the fixture of the sampler, resume and look-ahead tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blobdata import FolderDataset


def sample_id(f: Any) -> int:
    """The loader: a sample is the number in its file name (``17.png`` -> 17)."""
    return int(Path(f.name).stem)


def write_id_folder(root: Path, n: int, *, per_class: int | None = None, payload: bytes = b"x") -> Path:
    """``n`` files ``c<k>/<i>.png`` under ``root``: class ``i % 3``, or ``i // per_class``."""
    for i in range(n):
        d = root / f"c{i // per_class if per_class else i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.png").write_bytes(payload)
    return root


def id_dataset(root: Path, n: int, *, per_class: int | None = None, lookahead: int = 16) -> FolderDataset:
    """A FolderDataset over :func:`write_id_folder`'s folder, loading each sample as its number."""
    return FolderDataset(write_id_folder(root, n, per_class=per_class), loader=sample_id, lookahead=lookahead)

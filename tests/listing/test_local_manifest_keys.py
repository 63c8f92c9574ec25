"""A manifest used for a local folder cannot name files outside it (issue 29, finding 5)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blobdata import FolderDataset
from blobdata._cli import main
from blobdata._errors import ConfigError
from blobdata._listing import Manifest, list_folder
from blobdata._url import check_relkeys, safe_relpath


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.png").write_bytes(b"inside")
    (tmp_path / "secret.txt").write_bytes(b"outside the root")
    return root


def _manifest_naming(root: Path, relkey: str, tmp_path: Path) -> Path:
    listed = list_folder(str(root))
    target = tmp_path / "secret.txt"
    st = target.stat()
    forged = Manifest.from_entries(
        listed.root,
        ["cat"],
        [("cat/a.png", 6, listed.identity(0), 0), (relkey, st.st_size, f"{st.st_mtime_ns}-{st.st_size}", 0)],
        listed_at=time.time(),
    )
    path = tmp_path / "forged.manifest"
    forged.save(path)
    return path


@pytest.mark.parametrize(
    "relkey", ["cat/../../secret.txt", "../secret.txt", "cat//x", "/etc/passwd", "cat/./a"]
)
def test_a_manifest_for_a_local_folder_cannot_name_keys_outside_it(tmp_path: Path, relkey: str) -> None:
    root = _folder(tmp_path)
    manifest = _manifest_naming(root, relkey, tmp_path)
    seen: list[Any] = []

    def loader(f: Any) -> bytes:
        seen.append(os.fspath(f))
        with open(f, "rb") as fh:
            return fh.read()

    with pytest.raises(ConfigError) as info:
        ds = FolderDataset(str(root), manifest=manifest, loader=loader)
        [ds[i] for i in range(len(ds))]
    assert repr(relkey) in str(info.value) and "local path" in str(info.value)
    assert not seen


def test_warm_with_such_a_manifest_reads_nothing_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _folder(tmp_path)
    manifest = _manifest_naming(root, "cat/../../secret.txt", tmp_path)
    code = main(["warm", str(root), "--manifest", str(manifest), "--cache-dir", str(tmp_path / "c"), "-q"])
    assert code == 2 and "cat/../../secret.txt" in capsys.readouterr().err


def test_the_key_check_finds_the_first_bad_key_among_many() -> None:
    good = [f"c{i % 7}/{i}.jpg" for i in range(10_000)]
    keys = "".join(good).encode()
    offsets = [0]
    for k in good:
        offsets.append(offsets[-1] + len(k.encode()))
    check_relkeys(keys, offsets, root="file:///r")
    for bad in ("c1/../x", "..", "c1/", "", "a\\b", "a\x00b", "./a", "c1//a", "c1/..", "c1/.", ".", "/a"):
        keys2 = "".join([*good[:5000], bad, *good[5000:]]).encode()
        lens = [len(k.encode()) for k in [*good[:5000], bad, *good[5000:]]]
        offs = [0]
        for n in lens:
            offs.append(offs[-1] + n)
        with pytest.raises(ConfigError) as info:
            check_relkeys(keys2, offs, root="file:///r")
        assert repr(bad) in str(info.value)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.text(alphabet="a./\\", max_size=5), min_size=1, max_size=6))
def test_the_key_check_agrees_with_safe_relpath(keys: list[str]) -> None:
    offsets = [0]
    for k in keys:
        offsets.append(offsets[-1] + len(k))
    refused = []
    for k in keys:
        try:
            safe_relpath(k)
        except ConfigError:
            refused.append(k)
    if refused:
        with pytest.raises(ConfigError) as info:
            check_relkeys("".join(keys).encode(), offsets, root="file:///r")
        assert repr(refused[0]) in str(info.value)
    else:
        check_relkeys("".join(keys).encode(), offsets, root="file:///r")

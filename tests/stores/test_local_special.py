"""A local folder is read as regular files only (issue 39, row 5): a link to ``/dev/zero`` is refused,
not read until memory runs out; a FIFO is refused at once, not waited on for ever; either is an error
naming the file that ``on_error="skip"`` skips. The same whether a batch reads the files itself (a local
disk) or the look-ahead reads them (asked for, or a network mount)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from blobdata import FetchError, FolderDataset


def _folder(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    for i in range(6):
        (root / "a" / f"{i}.png").write_bytes(bytes([i]) * 10)
    os.symlink("/dev/zero", root / "a" / "zero.png")
    os.mkfifo(root / "a" / "fifo.png")
    return root


def _read(f: object) -> bytes:
    return f.read()  # type: ignore[attr-defined, no-any-return]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lookahead", [None, 16])
def test_special_files_are_refused_naming_them(tmp_path: Path, lookahead: int | None) -> None:
    root = _folder(tmp_path)
    extra = {} if lookahead is None else {"lookahead": lookahead}
    ds = FolderDataset(root, loader=_read, **extra)
    assert len(ds) == 8  # listed as torchvision lists them
    names = [Path(p).name for p, _ in ds.samples]
    for name, what in (("zero.png", "character device"), ("fifo.png", "FIFO")):
        with pytest.raises(FetchError) as info:
            ds[names.index(name)]
        text = str(info.value)
        assert name in text and what in text and "regular files only" in text and 'on_error="skip"' in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lookahead", [None, 16])
def test_skip_goes_past_them_and_the_process_ends(tmp_path: Path, lookahead: int | None) -> None:
    """In a child process (a hang or a runaway read would show as its timeout): the loader serves the six
    regular files, reports the two others, and the interpreter exits promptly."""
    root = _folder(tmp_path)
    extra = "" if lookahead is None else f", lookahead={lookahead}"
    code = textwrap.dedent(f"""
        import sys
        from blobdata import FolderDataset
        ds = FolderDataset({str(root)!r}, loader=lambda f: f.read(), on_error="skip"{extra})
        got = [x for b, _ in ds.dataloader(batch_size=4, collate_fn=lambda s: tuple(zip(*s))) for x in b]
        print(sorted(len(x) for x in got), sorted(u.rsplit("/", 1)[1] for u, _ in ds.errors))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=45)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[10, 10, 10, 10, 10, 10] ['fifo.png', 'zero.png']"

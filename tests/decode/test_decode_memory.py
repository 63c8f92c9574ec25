"""Issue 29, the decode path: the default loader decodes from memory and writes no file; a temporary copy
is made only for a ``loader=`` that asks for a path, removed when it returns, and copies left by killed
processes are swept.

What a decode writes is seen with an audit hook (PEP 578): every ``open``/``os.open`` of a file for
writing under ``/dev/shm`` or the temporary directory raises the ``open`` audit event, whatever code
makes it (``tempfile.mkstemp``, a plain ``open``)."""

import io
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import blobdata
from blobdata import FolderDataset
from blobdata._decode import decode, sweep_dead_copies
from blobdata._node import shm_root
from blobdata.testing import synthetic_jpeg

_ROOTS = tuple({os.path.realpath(p) for p in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(p)})
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_seen: list[str] | None = None  # where the hook records, while a test listens


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if _seen is None or event not in ("open", "os.mkdir", "os.rename", "os.link", "os.symlink"):
        return
    path = args[0]
    if not isinstance(path, str | bytes | os.PathLike):
        return
    if event == "open":
        mode, flags = args[1], args[2]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and isinstance(flags, int) and flags & _WRITE
        )
        if not writes:
            return
    full = os.path.realpath(os.fsdecode(path))
    if any(full == root or full.startswith(root + os.sep) for root in _ROOTS):
        _seen.append(full)


sys.addaudithook(_hook)


@contextmanager
def _written() -> Iterator[list[str]]:
    """The files and directories created or opened for writing under /dev/shm or the temporary
    directory, by this process, inside the block."""
    global _seen
    _seen = []
    try:
        yield _seen
    finally:
        _seen = None


def _copies() -> set[str]:
    """Every file in a copy directory of this user's (``<root>/blobdata-<uid>/copies-<pid>-*/``) in the
    node state this process uses (the suite's own, ``BLOBDATA_NODE_DIR``): not the machine's, where
    other runs on the node make and remove copies of their own meanwhile."""
    out = set()
    mine = os.path.join(shm_root(), f"blobdata-{os.geteuid()}")
    for d in os.listdir(mine) if os.path.isdir(mine) else ():
        if d.startswith("copies-"):
            out |= {os.path.join(mine, d, n) for n in os.listdir(os.path.join(mine, d))}
    return out


def _copy_of(path: str, pid: int) -> bool:
    """Whether ``path`` is a temporary copy made by process ``pid``."""
    return os.path.basename(os.path.dirname(path)).startswith(f"copies-{pid}-")


def _objects() -> dict[str, bytes]:
    rng = np.random.default_rng(29)
    return {f"train/c{i % 2}/{i}.jpg": synthetic_jpeg(rng, min_side=64, max_side=96) for i in range(4)}


@pytest.mark.network
@pytest.mark.timeout(120)
def test_the_default_loader_writes_no_file_while_decoding_a_bucket_object(s3_bucket: Any) -> None:
    objects = _objects()
    s3_bucket.put_many(objects)
    options = s3_bucket.storage_options
    ds = FolderDataset(s3_bucket.url("train"), storage_options=options, lookahead=0)
    ds[0]  # the first access sets up what a dataset keeps (connections, node state), not decoding
    before = _copies()
    with _written() as written:
        img, _ = ds[1]
    assert isinstance(img, Image.Image) and img.mode == "RGB"
    expected = Image.open(io.BytesIO(objects[_key(ds, 1)])).convert("RGB")
    assert np.array_equal(np.asarray(img), np.asarray(expected))
    assert written == [], f"the default loader wrote {written}"
    assert _copies() == before
    # The hook sees such writes: a loader that asks for a path makes its copy where it looks.
    by_path = FolderDataset(s3_bucket.url("train"), storage_options=options, lookahead=0,
                            loader=lambda f: Path(os.fspath(f)).read_bytes())  # fmt: skip
    by_path[0]
    with _written() as written:
        assert by_path[1][0] == objects[_key(by_path, 1)]
    assert len(written) == 1 and _copy_of(written[0], os.getpid()) and not os.path.exists(written[0])


def _key(ds: FolderDataset, i: int) -> str:
    return "train/" + ds.samples[i][0].split("/train/", 1)[1]


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_loader_asking_for_a_path_works_and_leaves_no_file(s3_bucket: Any) -> None:
    objects = _objects()
    s3_bucket.put_many(objects)
    made: list[str] = []

    def fspath(f: Any) -> bytes:
        made.append(os.fspath(f))
        with open(os.fspath(f), "rb") as fh:
            return fh.read()

    def as_str(f: Any) -> bytes:  # cv2.imread(str(p)) style
        made.append(str(f))
        assert str(f).endswith(".jpg") and f.endswith(".jpg")
        return Path(str(f)).read_bytes()

    def opened(f: Any) -> bytes:  # ImageFolder's pil_loader: open(path, "rb")
        with open(f, "rb") as fh:
            made.append(fh.name)
            return fh.read()

    def pillow(f: Any) -> bytes:  # Image.open(f): Pillow opens a path-like by path
        with Image.open(f) as img:
            made.append(str(img.filename))
            return img.convert("RGB").tobytes()

    def failing(f: Any) -> None:
        made.append(os.fspath(f))
        raise RuntimeError("a broken loader")

    before = _copies()
    for loader in (fspath, as_str, opened):
        ds = FolderDataset(s3_bucket.url("train"), storage_options=s3_bucket.storage_options, loader=loader)
        assert [ds[i][0] for i in range(len(ds))] == [objects[_key(ds, i)] for i in range(len(ds))]
    ds = FolderDataset(s3_bucket.url("train"), storage_options=s3_bucket.storage_options, loader=pillow)
    assert ds[2][0] == Image.open(io.BytesIO(objects[_key(ds, 2)])).convert("RGB").tobytes()
    broken = FolderDataset(s3_bucket.url("train"), storage_options=s3_bucket.storage_options, loader=failing,
                           on_error="skip")  # fmt: skip
    assert broken.__getitems__(list(range(len(objects)))) == [] and len(broken.errors) == len(objects)
    assert len(made) == 3 * len(objects) + 1 + len(objects)
    assert all(_copy_of(p, os.getpid()) for p in made)
    assert not any(os.path.exists(p) for p in made)  # each removed when its loader returned or raised
    assert _copies() == before


def test_a_copy_is_private_and_made_once_per_sample() -> None:
    paths: list[str] = []

    def loader(f: Any) -> int:
        paths.extend((os.fspath(f), str(f), os.fspath(f)))
        return os.stat(os.fspath(f)).st_mode & 0o777

    assert decode(b"bytes of an object", "s3://b/x/y.png", loader) == 0o600
    assert len(set(paths)) == 1 and paths[0].endswith(".png") and not os.path.exists(paths[0])
    assert decode(b"\x89PNG", "s3://b/x/y.png", lambda f: f.read()) == b"\x89PNG"  # no path asked: none


class _PathLoaderDataset(torch.utils.data.Dataset[str]):
    """Each sample: the path a path-asking loader was given, in the worker that decoded it."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> str:
        def loader(f: Any) -> str:
            with open(f, "rb") as fh:
                assert fh.read() == b"abc"
            return os.fspath(f)

        return str(decode(b"abc", f"s3://b/c/{i}.jpg", loader))


@pytest.mark.timeout(120)
def test_dataloader_workers_remove_their_copy_directories_when_they_end() -> None:
    loader = torch.utils.data.DataLoader(_PathLoaderDataset(), batch_size=2, num_workers=2)
    paths = [p for batch in loader for p in batch]
    dirs = {os.path.dirname(p) for p in paths}
    assert len(paths) == 6 and len(dirs) == 2  # one directory per worker
    assert not any(os.path.exists(p) for p in paths)
    assert not any(os.path.exists(d) for d in dirs)  # removed as each worker ended, not left to a sweep


# -- copies left by killed processes ------------------------------------------------------------------
_HOLD = """
import os, sys, time
from blobdata._decode import decode
def loader(f):
    print(os.fspath(f), flush=True)
    time.sleep(60)
decode(b"pixels", "s3://b/c/killed.jpg", loader)
"""

_ASK = """
import os
from blobdata._decode import decode
print(decode(b"abc", "s3://b/c/next.jpg", lambda f: open(f, "rb").read().decode()))
"""


def _python(code: str, **kwargs: Any) -> subprocess.Popen[str]:
    root = os.path.dirname(os.path.dirname(blobdata.__file__))  # this checkout's blobdata in the child
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    return subprocess.Popen([sys.executable, "-c", code], env=env, text=True, **kwargs)


@pytest.mark.timeout(120)
def test_a_copy_left_by_a_killed_process_is_swept_by_the_next_copy() -> None:
    holder = _python(_HOLD, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        left = holder.stdout.readline().strip()
        assert _copy_of(left, holder.pid) and os.path.exists(left)
        parent = os.path.dirname(os.path.dirname(left))  # /dev/shm/blobdata-<uid>
        assert parent.endswith(f"blobdata-{os.geteuid()}") and oct(os.stat(left).st_mode & 0o777) == "0o600"
        assert sweep_dead_copies(parent) == []  # its owner still runs: kept
    finally:
        holder.kill()  # SIGKILL mid-decode: the copy stays behind
        holder.communicate(timeout=30)
    assert os.path.exists(left)
    nxt = _python(_ASK, stdout=subprocess.PIPE)
    out, _ = nxt.communicate(timeout=60)
    assert nxt.returncode == 0 and out.strip() == "abc"
    assert not os.path.exists(left) and not os.path.exists(os.path.dirname(left))  # swept by the next copy


def test_the_sweep_removes_only_dead_owners_copy_directories(tmp_path: Path) -> None:
    dead = _python("pass")
    dead.wait(30)
    alive = _python("import time; time.sleep(60)")
    try:
        names = {
            "dead": f"copies-{dead.pid}-a",
            "alive": f"copies-{alive.pid}-b",
            "mine": f"copies-{os.getpid()}-c",
            "plan": f"plan-{dead.pid}-d",
            "odd": "copies-x-e",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "object-1.jpg").write_bytes(b"x")
        target = tmp_path / "target"
        target.mkdir()
        (tmp_path / f"copies-{dead.pid}-link").symlink_to(target)
        assert sweep_dead_copies(str(tmp_path)) == [str(tmp_path / names["dead"])]
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {*names.values(), "target", f"copies-{dead.pid}-link"} - {names["dead"]}
    finally:
        alive.kill()
        alive.wait(30)

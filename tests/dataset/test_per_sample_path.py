"""The per-sample path's structure, held by counts that do not depend on the machine's speed (issue 37):
Python function calls and system calls per sample served, in the thread that serves batches and on the
process's event loop, for a local folder and for cache hits. Times are for
``benchmarks/bench_overhead.py``; these budgets catch a change that adds work per sample (a call, a
syscall, a task on the loop) whatever the box. Each is counted in a process of its own: the event loop
is one per process, and what an earlier test left running there was counted as this path's (the local
folder's loop once counted 2.4 calls per sample in a CI run, against 0.17 alone)."""

from __future__ import annotations

import cProfile
import fcntl
import gc
import json
import os
import pstats
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from blobdata import FolderDataset
from blobdata._dataset.loader import RESULT_PIPE_BYTES
from blobdata._loop import run

N = 256
BATCH = 64
EPOCHS = 3

#: Function calls per sample served (measured: local 34.0 and 0.1; cache hits 36.2 and 5.2), with room.
LOCAL_CALLS, LOCAL_LOOP_CALLS = 42, 1.0
HIT_CALLS, HIT_LOOP_CALLS = 45, 8


def _folder(root: Path) -> Path:
    for i in range(N):
        d = root / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04d}.png").write_bytes(bytes([i % 256]) * 3000)
    return root


def _read_len(f: Any) -> int:
    return len(f.read())


def _profiled(loader: Any) -> tuple[pstats.Stats, pstats.Stats, int]:
    """Profiles of the thread serving batches and of the event loop's thread over ``EPOCHS`` epochs
    (after one untimed), and the samples served."""
    for _ in loader:
        pass
    main, loop = cProfile.Profile(), cProfile.Profile()

    async def on() -> None:
        loop.enable()

    async def off() -> None:
        loop.disable()

    # Earlier tests' garbage is collected first, and no cycle collection runs inside the window: a
    # finalizer it would run there (an earlier loader's plan channel removed by shutil.rmtree, whose
    # os.open was counted once as this path's) is not this path's work.
    gc.collect()
    gc.disable()
    run(on())
    main.enable()
    n = 0
    try:
        for _ in range(EPOCHS):
            for batch in loader:
                n += len(batch[1])
    finally:
        main.disable()
        run(off())
        gc.enable()
    return pstats.Stats(main), pstats.Stats(loop), n


def _calls(stats: pstats.Stats, name: str, of: str = "") -> int:
    """Calls of the built-in ``name`` (``posix.open`` ...), or method ``name`` of ``of``, in a profile."""
    label = f"<method {name!r} of {of!r} objects>" if of else f"<built-in method {name}>"
    return sum(v[1] for k, v in stats.stats.items() if k[2] == label)  # type: ignore[attr-defined]


_COUNTED = {  # the calls each test reads: (thread, built-in or method, of)
    "main": [("posix.open", ""), ("posix.fstat", ""), ("posix.read", ""), ("posix.close", ""),
             ("posix.pread", ""), ("execute", "sqlite3.Connection")],
    "loop": [("posix.read", ""), ("posix.pread", ""), ("execute", "sqlite3.Connection")],
}  # fmt: skip


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The profiles of a shuffled loader over ``spec``'s folder (``root``; with ``cache``: filled first,
    every sample then a hit), reduced to counts: run in a process of its own (:func:`_in_child`)."""
    options: dict[str, Any] = {}
    if spec.get("storage_options"):
        options["storage_options"] = spec["storage_options"]
    if spec.get("cache"):
        options.update(cache=spec["cache"], lookahead=1024)
    ds = FolderDataset(spec["root"], loader=_read_len, **options)
    if spec.get("cache"):
        for _ in ds.dataloader(batch_size=BATCH):  # fills the cache
            pass
        ds.close()
    loader = ds.dataloader(batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    main, loop, n = _profiled(loader)
    profiles = {"main": main, "loop": loop}
    return {
        "n": n,
        "from_bucket": loader.stats().samples_from_bucket,
        **{f"{k} calls": v.total_calls for k, v in profiles.items()},  # type: ignore[attr-defined]
        **{
            f"{k} {name}": _calls(profiles[k], name, of)
            for k, names in _COUNTED.items()
            for name, of in names
        },
    }


def _in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`_measure` in a fresh process. The event loop of a process is shared by everything that
    ran in it: an earlier test's reads still ending there would be counted as this path's work."""
    root = Path(__file__).resolve().parents[2]
    code = "import json, sys; from tests.dataset.test_per_sample_path import _measure; "
    code += "print(json.dumps(_measure(json.loads(sys.argv[1]))))"
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_local_folder_costs_a_read_per_sample_and_nothing_on_the_loop(tmp_path: Path) -> None:
    got = _in_child({"root": str(_folder(tmp_path / "d"))})
    n = got["n"]
    assert n == EPOCHS * N
    assert got["main calls"] / n <= LOCAL_CALLS
    assert got["loop calls"] / n <= LOCAL_LOOP_CALLS
    # One open, fstat, read and close per file, in the thread that uses the bytes.
    for syscall in ("posix.open", "posix.fstat", "posix.read", "posix.close"):
        assert got[f"main {syscall}"] == n, syscall
    assert got["loop posix.read"] == 0


@pytest.mark.parametrize("where", ["local", "s3"])
def test_cache_hits_cost_one_lookup_per_batch(
    tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """Every sample a cache hit: one index query per batch in the thread serving it, and on the loop
    only the look-ahead's presence lookups (one per batch), no task and no file read per sample."""
    root: Any = _folder(tmp_path / "d")
    spec: dict[str, Any] = {"root": str(root), "cache": str(tmp_path / "cache")}
    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        bucket.put_many({f"d/{p.relative_to(root)}": p.read_bytes() for p in root.rglob("*.png")})
        spec.update(root=bucket.url("d"), storage_options=bucket.storage_options)
    got = _in_child(spec)
    n = got["n"]
    assert n == EPOCHS * N and got["from_bucket"] == 0
    assert got["main calls"] / n <= HIT_CALLS
    assert got["loop calls"] / n <= HIT_LOOP_CALLS
    batches = EPOCHS * N // BATCH
    queries = got["main execute"]
    assert batches <= queries <= batches + 1, queries  # one lookup per batch, and the first
    assert got["main posix.read"] == got["loop posix.read"] == 0  # small values: in the index
    assert got["loop posix.pread"] == got["main posix.pread"] == 0
    # Every sample was read from the cache by this process in the untimed epoch: the look-ahead knows
    # them held and looks none up again.
    assert got["loop execute"] == 0


def test_a_sample_known_held_but_trimmed_away_is_fetched_not_lost(tmp_path: Path) -> None:
    """The look-ahead trusts what this process read from an "admit" cache: an entry cleared since is a
    miss when its batch reads the cache, fetched then, and the same bytes come back."""
    root = _folder(tmp_path / "d")
    ds = FolderDataset(root, loader=_read_len, cache=tmp_path / "cache", lookahead=1024)
    loader = ds.dataloader(batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    first = sorted(x for b, _ in loader for x in b.tolist())
    assert ds._proc is not None and ds._proc.writer is not None and ds._proc.writer.flush(30.0)
    again = sorted(x for b, _ in loader for x in b.tolist())  # every sample a hit: all known held now
    assert ds._proc.held is not None and not ds._proc.held.unknown(list(range(N)))
    ds.cache.clear()  # type: ignore[union-attr]
    third = sorted(x for b, _ in loader for x in b.tolist())
    assert first == again == third == sorted([3000] * N)
    assert loader.stats().samples == 3 * N


def test_held_marks_are_one_bit_per_sample() -> None:
    from blobdata._dataset.reads import Held

    held = Held(21)
    assert held.unknown([0, 7, 8, 20]) == [0, 7, 8, 20]
    held.mark([0, 7, 8, 9, 20], [True, True, True, False, True])
    assert held.unknown(list(range(21))) == [i for i in range(21) if i not in (0, 7, 8, 20)]
    held.mark([7, 1], [False, True])  # a miss clears only its own bit
    assert held.unknown([0, 1, 7, 8]) == [7]


def _wide_pipes() -> set[int]:
    """This process's pipes (by inode: both ends of one may be open here) of at least the capacity
    blobdata's loader gives its workers' results."""
    pipes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) >= RESULT_PIPE_BYTES:
                pipes.add(st.st_ino)
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return pipes


def _read_bytes(f: Any) -> bytes:
    return bytes(f.read())


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_batches_cross_a_pipe_as_wide_as_a_batch(tmp_path: Path, persistent: bool) -> None:
    """A batch that is not tensors (here lists of bytes: 64 x 3 KB) is pickled through the pipe from a
    worker to the training process; at the kernel's 64 KiB it crosses in turns that each wait for both
    processes (benchmarks/bench_batch_pipe.py). blobdata's loader widens that pipe, every epoch's
    iterator and persistent workers' alike; a plain DataLoader over the same dataset does not. Pipes
    are told apart by inode: one an earlier iterator left open until collected is not this one's."""
    ds = FolderDataset(_folder(tmp_path / "d"), loader=_read_bytes)
    before = _wide_pipes()
    plain = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=list)
    seen = [_wide_pipes() - before for _ in plain]
    assert seen and not any(seen)  # the control: the kernel's default is narrower
    loader = ds.dataloader(batch_size=BATCH, num_workers=2, collate_fn=list, persistent_workers=persistent)
    first: set[int] = set()
    for epoch in range(2):  # a new iterator (new workers, a new pipe) in the second epoch unless persistent
        known, got = _wide_pipes(), []
        for batch in loader:
            got.append(len(batch))
            now = _wide_pipes()
            if persistent and epoch:  # the first epoch's iterator and pipe, still as wide
                assert not now - known and first <= now
            else:
                assert len(now - known) == 1
                first = now - known
        assert got == [BATCH] * (N // BATCH)


@pytest.mark.timeout(120)
def test_bench_batch_pipe_runs_small(tmp_path: Path) -> None:
    """benchmarks/bench_batch_pipe.py end to end at a small size: every kind and setting timed with
    both pipes, each time a positive number of milliseconds per batch."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out.json"
    cmd = [sys.executable, "benchmarks/bench_batch_pipe.py", "--batches", "4", "--rounds", "1"]
    cmd += ["--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "widened / plain" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert {(r["kind"], r["setting"]) for r in results} == {
        (k, s) for k in ("bytes", "numpy", "tensor") for s in ("quiet", "busy")
    }
    assert all(r["plain_ms"] > 0 and r["widened_ms"] > 0 for r in results)

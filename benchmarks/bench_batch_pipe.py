"""The workers' batches on their way to the training process: the pipe DataLoader gives them (64 KiB on
Linux) against the one blobdata's loader widens it to (:data:`blobdata._dataset.loader.RESULT_PIPE_BYTES`).

A DataLoader's worker sends each batch pickled through one pipe; tensors cross in shared memory (a
handle through the pipe), anything else (bytes, numpy arrays, strings: what a ``collate_fn`` that does
not make tensors returns) crosses the pipe itself, in turns of the pipe's capacity, each of which needs
the worker's writing thread and the training process's reading thread to run and to take their
process's GIL. The same ``torch.utils.data.DataLoader`` is timed with its own pipe (``plain``) and with
the pipe widened as ``BlobLoader`` widens it (``widened``), for batches of

- ``bytes``   a list of the samples' bytes (``collate_fn=list``)
- ``numpy``   one uint8 array of the batch (``np.stack``)
- ``tensor``  one uint8 tensor (``default_collate``): shared memory, the control (no change expected)

``quiet``: the training process does nothing else; ``busy``: another thread of it runs Python
meanwhile (a peer service, a logger, a tokenizer). Each setting is timed ``--rounds`` times,
interleaved, from the first batch to the last (the workers' start left out), and its median printed
in milliseconds per batch, with the ratio widened / plain.

    python benchmarks/bench_batch_pipe.py [--batches 100] [--batch 32] [--size 27000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from common import add_repo_to_path, table

add_repo_to_path()

import numpy as np  # noqa: E402
import torch.utils.data  # noqa: E402

from blobdata._dataset.loader import RESULT_PIPE_BYTES, widen_result_pipe  # noqa: E402

KINDS = ("bytes", "numpy", "tensor")
SETTINGS = ("quiet", "busy")


class _Samples(torch.utils.data.Dataset[Any]):
    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        return bytes([i % 251]) * self.size


class _Arrays(_Samples):
    def __getitem__(self, i: int) -> Any:
        return np.full(self.size, i % 251, dtype=np.uint8)


class _Widened(torch.utils.data.DataLoader[Any]):
    """A plain DataLoader whose iterator's result pipe is widened as BlobLoader's is."""

    def _get_iterator(self) -> Any:
        iterator = super()._get_iterator()
        widen_result_pipe(iterator)
        return iterator


def _default_pipe_bytes() -> int:
    """The capacity this kernel gives a new pipe (what ``plain`` runs with)."""
    r, w = os.pipe()
    try:
        return int(fcntl.fcntl(r, fcntl.F_GETPIPE_SZ))
    finally:
        os.close(r)
        os.close(w)


def _stack(batch: list[Any]) -> Any:
    return np.stack(batch)


def make_loader(kind: str, widened: bool, args: Any) -> Any:
    """A DataLoader of ``args.batches`` batches of ``kind`` (``args.batch`` samples of ``args.size``
    bytes, ``args.workers`` workers), its result pipe widened or not (bench_peer_service uses it too)."""
    n = args.batches * args.batch
    dataset = _Samples(n, args.size) if kind == "bytes" else _Arrays(n, args.size)
    collate: Any = {"bytes": list, "numpy": _stack, "tensor": torch.utils.data.default_collate}[kind]
    cls = _Widened if widened else torch.utils.data.DataLoader
    return cls(dataset, batch_size=args.batch, num_workers=args.workers, collate_fn=collate)


def _one(kind: str, widened: bool, busy: bool, args: Any) -> float:
    """Milliseconds per batch from the first batch to the last."""
    loader = make_loader(kind, widened, args)
    stop = threading.Event()

    def spin() -> None:  # Python that holds the GIL until the interpreter makes it switch
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    try:
        it = iter(loader)
        next(it)
        t0 = time.perf_counter()
        got = sum(1 for _ in it)
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        if busy:
            spinner.join()
    return 1000.0 * seconds / max(1, got)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--batch", type=int, default=32, help="samples per batch")
    p.add_argument("--size", type=int, default=27000, help="bytes per sample")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        p.error(f"--kinds takes {', '.join(KINDS)}; got {', '.join(sorted(unknown))}")
    times: dict[tuple[str, str, bool], list[float]] = {}
    for _ in range(args.rounds):  # interleaved: the machine's noise falls on every setting alike
        for kind in kinds:
            for setting in SETTINGS:
                for widened in (False, True):
                    ms = _one(kind, widened, setting == "busy", args)
                    times.setdefault((kind, setting, widened), []).append(ms)
    batch_kb = args.batch * args.size / 1000
    print(
        f"{args.batches} batches of {args.batch} x {args.size} bytes ({batch_kb:.0f} KB), {args.workers} "
        f"workers, median of {args.rounds} rounds; the pipe: {_default_pipe_bytes() // 1024} KiB (plain) or "
        f"{RESULT_PIPE_BYTES // 1024} KiB (widened), ms per batch"
    )
    rows, out = [], []
    for kind in kinds:
        for setting in SETTINGS:
            plain = statistics.median(times[(kind, setting, False)])
            wide = statistics.median(times[(kind, setting, True)])
            ratio = wide / plain if plain else float("nan")
            rows.append([kind, setting, f"{plain:.2f}", f"{wide:.2f}", f"{ratio:.2f}"])
            out.append(
                {"kind": kind, "setting": setting, "plain_ms": plain, "widened_ms": wide, "ratio": ratio}
            )
    print(table(["batch", "training process", "plain ms", "widened ms", "widened / plain"], rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

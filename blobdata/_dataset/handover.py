"""The next epoch's first batches, fetched in the training process for workers that do not outlive the
epoch (``persistent_workers=False``), and found by those workers in their forked copy of the dataset.

:class:`~blobdata._dataset.loader.BlobLoader` calls :func:`start` near an epoch's end with what the new
workers will not find in the node's cache (:func:`~blobdata._dataset.peering.not_kept`),
:func:`settle` before it forks them and :func:`drop` once they exist; a worker given a hand-over
takes it at its first batch (:func:`adopt`), and the thread serving its first batches reads it as it
reads the cache's hits, without waiting for the worker's loop. See ``docs/resume.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.utils.data

from .. import _process
from .._loop import run, submit
from .._metrics import stats as _stats

if TYPE_CHECKING:
    from .reads import ProcessState

__all__ = ["adopt", "drop", "settle", "start"]

# ``ds`` is a BlobDatasetBase (typed Any, as in .peering: base imports this module).


def start(ds: Any, indices: Sequence[int]) -> None:
    """Start fetching ``indices`` in this process (within the look-ahead's bounds) for the workers it
    forks next. What fails is left to the worker given it (which reports it)."""
    chosen: list[int] = []
    total = 0
    for i in indices:
        size = ds._size_of(int(i))
        if len(chosen) >= ds.lookahead or (chosen and total + size > ds.lookahead_bytes):
            break
        chosen.append(int(i))
        total += size
    drop(ds)
    if chosen:
        with _stats.for_next_epoch():  # the next epoch's first batches
            ds._process().handing = submit(_fetch(ds, chosen, ds._handoff))


async def _fetch(ds: Any, chosen: list[int], into: dict[int, Any]) -> None:
    async def one(i: int) -> None:
        with contextlib.suppress(Exception):
            into[i] = await ds._load(i)

    await asyncio.gather(*(one(i) for i in chosen))


def settle(ds: Any, wait_s: float = 2.0) -> None:
    """Before workers are forked: the hand-over's fetches done (they are those workers' first batches),
    or, past ``wait_s``, cancelled, and this process's loop back to waiting."""
    proc = ds._proc
    handing = proc.handing if proc is not None and proc.pid == _process.pid() else None
    if handing is None:
        return
    try:
        handing.result(timeout=wait_s)
    except concurrent.futures.TimeoutError:
        handing.cancel()
        run(asyncio.sleep(0))  # the loop has run the cancellation
    except Exception:  # cancelled (a new epoch began): nothing to hand over, nothing to wait for
        return


def adopt(ds: Any, proc: ProcessState) -> None:
    """In a worker forked with a hand-over, at its first batch: the hand-over becomes this process's
    (:attr:`ProcessState.handed`), which the thread serving its batches takes from as it reads the
    node cache (:func:`~blobdata._dataset.reads.take_handed`), and which its look-ahead does not
    stage. Nothing here waits for the worker's loop, nor starts it: a first batch that the hand-over
    and the cache hold is read without it, as a cache's hits are."""
    if ds._handoff and torch.utils.data.get_worker_info() is not None:
        handoff, ds._handoff = ds._handoff, {}
        proc.handed.update(handoff)


def drop(ds: Any) -> None:
    """The workers that were to find the hand-over have started (or will not): drop this copy."""
    ds._handoff = {}
    proc = ds._proc
    if proc is not None and proc.pid == _process.pid() and proc.handing is not None:
        proc.handing.cancel()
        proc.handing = None

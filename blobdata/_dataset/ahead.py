"""A batch built before it is asked for: a persistent worker's first batch of the next epoch.

A persistent DataLoader deals each epoch from worker 0 again, only once the training loop has taken
the previous epoch's last batch and reset its workers; the first batch then waits for one worker to
make it whole, about ``num_workers`` times the epoch's mean time per batch. Where the next epoch's
batches are announced (:mod:`blobdata._fetch.lookahead`, persistent workers), a worker that has made
its last batch of an epoch is idle until then: it builds, in a thread, the first batch it will be
given in the next one, and hands it over when that very batch (same indices, same augmentation seed)
arrives. Anything else (another order, a failed sample, a transform's error) drops it, and the batch
is made as if nothing had been built.

Exact: the samples are made by the same code from the same bytes. blobdata's transforms and
``blobdata.sample_rng()`` draw per sample (seed, URL), so the thread changes nothing. A transform that
draws from torch's, numpy's or ``random``'s global generators draws, in the thread, what it would have
drawn on demand, in the same order (the worker draws nothing in between); where the built batch is not
used, those generators are put back as they were before it, so the draws are as if it never ran.
"""

from __future__ import annotations

import multiprocessing.util as mp_util
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["BuiltAhead", "Stopped"]


class Stopped(Exception):
    """Raised inside a batch being built ahead when it will not be used."""


class BuiltAhead:
    """One batch (``indices``, keyed by ``seed``) being built by ``build(stop, staged)`` in a thread;
    ``staged[0]``: how many of its samples the build took from the look-ahead, counted when the batch
    is served (in the epoch it belongs to, not in the one it was built during)."""

    def __init__(
        self,
        indices: list[int],
        seed: int | None,
        build: Callable[[threading.Event, list[int]], list[Any]],
    ) -> None:
        self.indices = indices
        self.seed = seed
        self.staged = [0]
        self._rng = _snapshot()
        self._stop = threading.Event()
        self._result: list[Any] | None = None
        # Not a daemon: a daemon thread still decoding when a spawned worker's interpreter ends can
        # abort it ("terminate called ..."), which the DataLoader reports as a killed worker. At the
        # worker's exit (multiprocessing's finalizers run before its threads are joined) it is told to
        # stop, and does between two samples.
        self._thread = threading.Thread(target=self._run, args=(build,), name="blobdata-build-ahead")
        mp_util.Finalize(self, self._stop.set, exitpriority=20)
        self._thread.start()

    def _run(self, build: Callable[[threading.Event, list[int]], list[Any]]) -> None:
        try:
            self._result = build(self._stop, self.staged)
        except BaseException:  # any failure: the batch is made again when asked for
            self._result = None

    def take(self, indices: list[int], seed: int | None) -> list[Any] | None:
        """The built batch if it is ``indices`` keyed by ``seed`` (waiting for it to be done), else
        None, with the global generators put back as they were before it was begun."""
        if indices != self.indices or seed != self.seed:
            self._stop.set()
        self._thread.join()
        if self._result is not None and not self._stop.is_set():
            return self._result
        _restore(self._rng)
        return None


def _snapshot() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _restore(state: tuple[Any, ...]) -> None:
    t, r, n = state
    torch.set_rng_state(t)
    random.setstate(r)
    np.random.set_state(n)

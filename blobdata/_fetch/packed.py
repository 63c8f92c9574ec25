"""An epoch's batches as numpy arrays in the main process, and the next epoch's, predicted in a thread
(see :class:`~blobdata._fetch.lookahead.PlanningBatchSampler` and :mod:`blobdata._sampling.peek`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, overload

import numpy as np

__all__ = ["PackedBatches", "Predicted"]


class PackedBatches(Sequence[Sequence[int]]):
    """An epoch's batches as numpy: batch ``k`` is ``flat[offsets[k]:offsets[k + 1]]`` (int64 arrays,
    never written to). Published and digested as they are; a batch becomes a list only when yielded."""

    __slots__ = ("flat", "offsets")

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat = flat
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, k: int) -> Any: ...
    @overload
    def __getitem__(self, k: slice) -> PackedBatches: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step != 1:
                raise ValueError("PackedBatches: only contiguous slices")
            stop = max(start, stop)
            offsets = self.offsets[start : stop + 1]
            return PackedBatches(self.flat[offsets[0] : offsets[-1]], offsets - offsets[0])
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        return self.flat[self.offsets[k] : self.offsets[k + 1]]


class Predicted:
    """The next epoch's batches, predicted in a thread while this one is served (main process only):
    ``prediction`` is a :class:`blobdata._sampling.peek.Prediction`."""

    def __init__(self, prediction: Any) -> None:
        self.prediction = prediction
        self.batches: PackedBatches | None = None
        self.done = threading.Event()

    def compute(self) -> PackedBatches:
        try:
            flat, offsets = self.prediction()
            self.batches = PackedBatches(flat, offsets)
            return self.batches
        finally:
            self.done.set()

    def take(self, batch_sampler: Any) -> PackedBatches | None:
        """The epoch's batches if the sampler is exactly in the state they were predicted from (then
        left as iterating it would have left it); None otherwise."""
        if not self.prediction.holds(batch_sampler):
            return None
        self.done.wait()  # the thread computes what iterating the sampler here would
        if self.batches is None:
            return None
        self.prediction.advance(batch_sampler)
        return self.batches

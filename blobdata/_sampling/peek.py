"""The next epoch's batches, known before it begins: what lets persistent workers fetch across an
epoch's end (see :mod:`blobdata._fetch.lookahead`).

Only for samplers whose next order is a function of state blobdata can read without changing it:
``SequentialSampler`` (the same order), ``RandomSampler`` with a generator (the order it will draw
from the generator's current state, which is restored), and ``DistributedSampler`` and its
subclasses (the order of the next epoch number, ``set_epoch`` being the user's: the step between
the last two epochs seen is assumed again, 1 at first). It works on a copy of the sampler, so the
prediction (about as long as an epoch's planning: a second for ImageNet's 1.28 M samples) runs in a
background thread, off the epoch's start. A wrong guess costs fetches (bounded by the
look-ahead's bytes), never a wrong batch: each epoch's real order is published when it begins.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .partition import PartitionedSampler
from .resume import ElasticDistributedSampler

__all__ = ["NextEpoch"]


class NextEpoch:
    """Predicts the batches a batch sampler yields in the epoch after the one begun."""

    def __init__(self, *, seed_drawn_from: torch.Generator | None = None) -> None:
        self._last_epoch: int | None = None
        self._step = 1
        # The loader's generator where each epoch's iterator draws the workers' base seed from it
        # before the sampler runs (a DataLoader makes a new iterator per epoch unless its workers
        # persist): a RandomSampler sharing it draws its next order after that draw.
        self._seed_drawn_from = seed_drawn_from

    def prepare(self, batch_sampler: Any) -> Callable[[], list[list[int]]] | None:
        """Call right after the batch sampler yielded the current epoch: a function that computes
        the next epoch's batches from a copy of the sampler's state (so it may run in another thread
        while the sampler is used), or None when they cannot be known."""
        if type(batch_sampler) is not BatchSampler:
            return None
        sampler: Any = batch_sampler.sampler
        size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
        if type(sampler) is SequentialSampler:
            clone: Any = sampler  # no state
        elif type(sampler) is RandomSampler:
            if not isinstance(sampler.generator, torch.Generator):
                return None  # it would draw its seed from torch's global generator
            clone = copy.copy(sampler)
            clone.generator = torch.Generator().set_state(sampler.generator.get_state())
            if sampler.generator is self._seed_drawn_from:
                torch.empty((), dtype=torch.int64).random_(generator=clone.generator)
        elif type(sampler) in (DistributedSampler, ElasticDistributedSampler, PartitionedSampler):
            epoch = int(sampler.epoch)
            if self._last_epoch is not None:
                self._step = epoch - self._last_epoch if epoch >= self._last_epoch else 1
            self._last_epoch = epoch
            clone = copy.copy(sampler)
            clone.epoch = epoch + self._step
            if isinstance(clone, ElasticDistributedSampler):
                clone.start = 0
            if isinstance(clone, PartitionedSampler):
                clone.consumed = []
        else:
            return None
        return lambda: [list(b) for b in BatchSampler(clone, size, drop_last)]

    def batches(self, batch_sampler: Any) -> list[list[int]] | None:
        """The next epoch's batches, computed now (see :meth:`prepare`)."""
        make = self.prepare(batch_sampler)
        return make() if make is not None else None

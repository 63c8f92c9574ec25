"""The next epoch's batches, known before it begins: what lets persistent workers fetch across an
epoch's end (see :mod:`blobdata._fetch.lookahead`).

Only for samplers whose next order is a function of state blobdata can read without changing it:
``SequentialSampler`` (the same order), ``RandomSampler`` with a generator (the order it will draw
from the generator's current state, which is restored), and ``DistributedSampler`` and its
subclasses (the order of the next epoch number, ``set_epoch`` being the user's: the step between
the last two epochs seen is assumed again, 1 at first). A wrong guess costs fetches (bounded by the
look-ahead's bytes), never a wrong batch: each epoch's real order is published when it begins.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .partition import PartitionedSampler
from .resume import ElasticDistributedSampler

__all__ = ["NextEpoch"]


class NextEpoch:
    """Predicts the batches a batch sampler yields in the epoch after the one begun."""

    def __init__(self) -> None:
        self._last_epoch: int | None = None
        self._step = 1

    def batches(self, batch_sampler: Any) -> list[list[int]] | None:
        """Call right after the batch sampler yielded the current epoch; None when it cannot be known."""
        if type(batch_sampler) is not BatchSampler:
            return None
        sampler = batch_sampler.sampler
        if type(sampler) is SequentialSampler:
            return [list(b) for b in batch_sampler]
        if type(sampler) is RandomSampler:
            gen = sampler.generator
            if not isinstance(gen, torch.Generator):
                return None  # it would draw its seed from torch's global generator
            state = gen.get_state()
            try:
                return [list(b) for b in batch_sampler]
            finally:
                gen.set_state(state)
        if isinstance(sampler, DistributedSampler) and type(sampler) in (
            DistributedSampler, ElasticDistributedSampler, PartitionedSampler
        ):  # fmt: skip
            return self._distributed(batch_sampler, sampler)
        return None

    def _distributed(self, batch_sampler: Any, sampler: Any) -> list[list[int]]:
        epoch = int(sampler.epoch)
        if self._last_epoch is not None:
            self._step = epoch - self._last_epoch if epoch >= self._last_epoch else 1
        self._last_epoch = epoch
        saved = dict(sampler.__dict__)
        try:
            sampler.epoch = epoch + self._step
            if isinstance(sampler, ElasticDistributedSampler):
                sampler.start = 0
            if isinstance(sampler, PartitionedSampler):
                sampler.consumed = []
            return [list(b) for b in batch_sampler]
        finally:
            sampler.__dict__.update(saved)

"""The loader :meth:`FolderDataset.dataloader` returns: a ``torch.utils.data.DataLoader`` whose order
blobdata sees, so every process can fetch ahead of the batches it will be given.

It is a subclass, built from DataLoader's own arguments, so it is used (and rebuilt by tools such as
Lightning, which re-instantiate a loader from its constructor's arguments) exactly like one. The
sampler and batch sampler are made as DataLoader makes them; blobdata only wraps the batch sampler
(:class:`~blobdata._lookahead.PlanningBatchSampler`) to publish each epoch's batches, which draws
nothing from any generator. ``batch_size``, ``sampler``, ``drop_last`` and ``len()`` report what was
asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.utils.data

from ._errors import ConfigError
from ._lookahead import PlanChannel, PlanningBatchSampler

__all__ = ["BlobLoader"]


class BlobLoader(torch.utils.data.DataLoader[Any]):
    """``torch.utils.data.DataLoader`` over a :class:`~blobdata.FolderDataset`, with look-ahead.

    Takes DataLoader's arguments with DataLoader's meaning and defaults. With the same arguments
    and the same seeded ``generator`` it yields exactly the batches a plain ``DataLoader`` yields.
    ``batch_size=None`` (no batching) is not supported: the look-ahead works per batch.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch.utils.data.Sampler[int] | Iterable[int] | None = None,
        batch_sampler: torch.utils.data.Sampler[list[int]] | Iterable[list[int]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None:
        attach = getattr(dataset, "_attach", None)
        if attach is None:
            raise ConfigError(f"BlobLoader reads a blobdata FolderDataset, got {type(dataset).__name__}")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ConfigError(
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and "
                    "drop_last (as in DataLoader)"
                )
            batches: Any = batch_sampler
            batch_size = getattr(batch_sampler, "batch_size", None)
            drop_last = bool(getattr(batch_sampler, "drop_last", False))
            sampler = getattr(batch_sampler, "sampler", None)
        else:
            if batch_size is None:
                raise ConfigError(
                    "batch_size=None (no automatic batching) is not supported by blobdata's loader"
                )
            if sampler is not None and shuffle:
                raise ConfigError("sampler option is mutually exclusive with shuffle (as in DataLoader)")
            if sampler is None:
                sampler = (
                    torch.utils.data.RandomSampler(dataset, generator=generator)
                    if shuffle
                    else torch.utils.data.SequentialSampler(dataset)
                )
            batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        self.channel = PlanChannel()
        attach(self.channel)
        super().__init__(
            dataset,
            batch_sampler=PlanningBatchSampler(batches, self.channel),
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=_WorkerInit(self.channel, worker_init_fn),
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        # What was asked for (DataLoader stores None and a SequentialSampler when given a batch
        # sampler); DataLoader forbids setting these after __init__, hence object.__setattr__.
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "drop_last", drop_last)
        self.user_worker_init_fn = worker_init_fn


class _WorkerInit:
    """Points the worker's dataset copy at its loader's plan channel, then runs the user's init."""

    def __init__(self, channel: PlanChannel, user: Callable[[int], None] | None) -> None:
        self.channel = channel
        self.user = user

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        attach = getattr(info.dataset, "_attach", None) if info is not None else None
        if attach is not None:
            attach(self.channel)
        if self.user is not None:
            self.user(worker_id)

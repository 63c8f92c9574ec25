"""The loader :meth:`FolderDataset.dataloader` returns: a ``torch.utils.data.DataLoader`` whose order
blobdata sees, so every process can fetch ahead of the batches it will be given.

It is a subclass, built from DataLoader's own arguments, so it is used exactly like one, and tools
that re-instantiate a loader from its constructor's arguments or its attributes (Lightning's
``_update_dataloader``, to put in a ``DistributedSampler`` or, for ``predict``, a batch sampler that
records indices) get a working BlobLoader back. The sampler and batch sampler are made as DataLoader
makes them and are what ``sampler`` and ``batch_sampler`` show; blobdata only wraps the batch sampler
it *iterates* (:class:`~blobdata._fetch.lookahead.PlanningBatchSampler`, DataLoader's ``_index_sampler``) to
publish each epoch's batches, which draws nothing from any generator. ``batch_size``, ``sampler``,
``batch_sampler``, ``drop_last`` and ``len()`` report what was asked for; ``len()`` stays the whole
epoch's batch count after ``load_state_dict`` (as torchdata's ``StatefulDataLoader``), while the resumed
epoch yields only the samples not yet read, batched at this loader's batch size.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.utils.data

from .._errors import ConfigError
from .._fetch import PlanChannel, PlanningBatchSampler
from .._metrics import LoaderStats, LoopClock, Records, SkipLog, TimedCollate, TimedIter, combined
from .._sampling import NextEpoch, Progress, loader_seed, own_generator, run_identity
from ..gpu._pipeline import DevicePipeline, collate_raw

__all__ = ["RESULT_PIPE_BYTES", "BlobLoader"]

#: The capacity the pipe that carries the workers' batches to the training process is given (Linux's
#: default is 64 KiB). A batch that is not tensors (bytes, arrays, strings: what a collate_fn that does
#: not make tensors returns) is pickled through that pipe, and at 64 KiB a batch of 1 MB crosses it in
#: 16 turns, each of which wakes the worker's writing thread and the training process's reading thread
#: and waits for their processes' GILs: half of a batch's cost unhindered, and 7x it when another thread
#: of the training process runs Python (``benchmarks/bench_batch_pipe.py``). Tensors cross in shared
#: memory (a handle through the pipe): no change. The kernel holds the pages only while a batch is in
#: the pipe; they count toward the user's pipe allowance (``/proc/sys/fs/pipe-user-pages-soft``, 64 MiB
#: by default) as 1 MiB per live iterator. Where the kernel refuses (that allowance used up, a
#: ``pipe-max-size`` below this), the pipe keeps its size.
RESULT_PIPE_BYTES = 2**20


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
        device: str | torch.device | None = None,
        gpu_transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> None:
        self.device_pipeline: DevicePipeline | None = None
        self.device = device
        self.gpu_transform = gpu_transform
        if device is not None or gpu_transform is not None:
            if device is None or gpu_transform is None:
                raise ConfigError(
                    "device= and gpu_transform= go together: the workers fetch bytes, and on the device "
                    "each batch is decoded, then gpu_transform (e.g. blobdata.gpu.TrainTransform(224)) "
                    "makes it one tensor"
                )
            if collate_fn is not None and getattr(collate_fn, "fn", collate_fn) is not collate_raw:
                raise ConfigError("with device=, batches are made by gpu_transform: collate_fn= is not used")
            raw_view = getattr(dataset, "_raw_view", None)
            if raw_view is None:
                raise ConfigError(f"device= needs a blobdata FolderDataset, got {type(dataset).__name__}")
            self.device_pipeline = DevicePipeline(
                gpu_transform, device, on_error=dataset.on_error, report=dataset._report, generator=generator
            )
            dataset = raw_view()
            collate_fn = collate_raw
        if isinstance(worker_init_fn, _WorkerInit):  # rebuilt from a BlobLoader's attributes
            worker_init_fn = worker_init_fn.user
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
                    torch.utils.data.RandomSampler(
                        dataset, generator=generator if generator is not None else own_generator()
                    )
                    if shuffle
                    else torch.utils.data.SequentialSampler(dataset)
                )
            batches = torch.utils.data.BatchSampler(sampler, batch_size, drop_last)
        self.channel = PlanChannel()
        attach(self.channel)
        # The augmentation's seed: with the epoch and each sample's URL, it keys every random draw of
        # blobdata's transforms (and sample_rng()) on the CPU path, and the GPU path's boxes.
        seed = loader_seed(generator, sampler)
        if self.device_pipeline is not None:
            self.device_pipeline.seed = seed
        self.progress = Progress(
            sampler,
            batch_size,
            seed,
            identity=functools.partial(run_identity, dataset, sampler, batch_size),
            batch_sampler=batches,
        )
        # What DataLoader iterates (its _index_sampler); `batch_sampler` stays the plain one, which
        # is what tools that rebuild a loader know how to re-make with another sampler.
        persistent = bool(persistent_workers and num_workers > 0)
        peek = NextEpoch(seed_drawn_from=None if persistent else generator)
        self._planner = PlanningBatchSampler(batches, self.channel, self.progress, next_epoch=peek)
        # Persistent workers outlive the epoch: their look-ahead runs on into the next one. Others
        # are started each epoch: the training process fetches their first batches for them.
        self._planner.across_epochs = persistent
        if num_workers > 0 and not persistent:
            self._planner.hand_over = _FirstBatches(dataset, num_workers, multiprocessing_context)
        super().__init__(
            dataset,
            batch_sampler=batches,
            num_workers=num_workers,
            collate_fn=TimedCollate(collate_fn or torch.utils.data.default_collate),
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
        self._clock = LoopClock()
        self._records = Records(self.channel.path)
        self._skips = SkipLog(self.channel.path)

    @property
    def _index_sampler(self) -> Any:
        # DataLoader's own property returns `batch_sampler`; the planner wraps it.
        return self._planner

    def __iter__(self) -> Any:
        """DataLoader's iterator, counted (for :meth:`state_dict`) and timed: the seconds the loop
        waits for batches count in :meth:`stats`, and each epoch's end logs a summary on the
        ``blobdata`` logger (INFO)."""
        if self.num_workers == 0:  # the dataset may serve several loaders: this one's plan now
            attach = getattr(self.dataset, "_attach", None)
            if attach is not None:
                attach(self.channel)
        # Before DataLoader's iterator draws its base seed from `generator` (which may be the
        # sampler's): a state taken before the first batch then replays this epoch.
        self.progress.at_iter()
        self._before_workers_start()
        dataloader_iter = super().__iter__
        pipeline = self.device_pipeline
        if pipeline is None:

            def plain() -> Iterator[Any]:
                return self._collect_skips(self._counted(self.progress.track(dataloader_iter())))

            return TimedIter(plain, self._clock, self._records)
        # Counted as the loop receives them (the pipeline works ahead); a batch whose every sample
        # was skipped counts but is not yielded, so that the sampler's position stays exact.

        def device_batches() -> Iterator[Any]:
            pipeline.stop_previous()  # before dataloader_iter() resets persistent workers' iterator
            batches = pipeline(dataloader_iter(), self.progress)  # the epoch numbers its augmentation
            return _present(self._collect_skips(self._counted(self.progress.track(batches))))

        return TimedIter(device_batches, self._clock, self._records)

    def _get_iterator(self) -> Any:
        iterator = super()._get_iterator()
        widen_result_pipe(iterator)
        return iterator

    def _before_workers_start(self) -> None:
        """New workers are about to be forked (each epoch without persistent workers): first let this
        process's own threads finish what blobdata gave them, the next epoch's prediction (torch) and
        the fetches handed over to those workers, so that no fork happens while one of them is
        inside torch or the runtime (a forked child can inherit a lock held by another thread)."""
        if not self.num_workers or getattr(self, "_iterator", None) is not None:
            return  # no workers, or persistent ones already started
        predicted = self._planner._predicted
        if predicted is not None:
            predicted.done.wait()
        settle = getattr(self.dataset, "_settle_hand_over", None)
        if settle is not None:
            settle()

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The samples of each batch the loop receives, as planned, in :meth:`stats` (``samples``)."""
        clock, progress = self._clock, self.progress
        for batch in batches:
            size = progress.last_size
            if size >= 0:
                clock.samples += size
            else:
                clock.unplanned += 1
            yield batch

    def _collect_skips(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Workers' ``on_error="skip"`` reports join ``dataset.errors`` here, batch by batch."""
        errors = getattr(self.dataset, "errors", None)
        done = False
        try:
            for batch in batches:
                if self.num_workers and errors is not None:
                    errors.extend(self._skips.drain())
                yield batch
            done = True
        finally:
            if not done and not self.num_workers:  # the epoch abandoned: stop fetching ahead for it
                drop = getattr(self.dataset, "_drop_staged", None)
                if drop is not None:
                    drop()
        if self.num_workers and errors is not None:
            errors.extend(self._skips.drain())

    def stats(self) -> LoaderStats:
        """What this loader did so far, summed over the training process and its workers (a
        :class:`~blobdata.LoaderStats`; ``.as_dict()`` for a metrics logger)."""
        c = self._clock
        main, parts = self._records.by_source()
        named = getattr(self.dataset, "_stats_sources", None)  # a mixture's sources: (name, LIST requests)
        sources = {}
        for k, (name, lists) in enumerate(named() if named is not None else ()):
            sources[name] = LoaderStats.from_totals(
                parts.get(k, 0 * main), loop_wait_s=0.0, loop_batches=0, elapsed_s=c.elapsed_s,
                list_requests=lists,
            )  # fmt: skip
        return LoaderStats.from_totals(
            combined(main, parts), loop_wait_s=c.wait_s, loop_batches=c.batches, elapsed_s=c.elapsed_s,
            loop_samples=c.samples if not c.unplanned else None,
            list_requests=int(getattr(self.dataset, "list_requests", 0)), sources=sources,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands (JSON-friendly, versioned): epoch, batches yielded in it, the
        sampler's seed or generator state at the epoch's start, the augmentation seed, what identifies
        the run (``"run"``: dataset URL, a digest of the listing, sampler, batch size) and a running
        digest of the indices served (``"served"``; compare two runs with :func:`blobdata.compare_runs`).
        See :mod:`blobdata._sampling.resume` and ``docs/resume.md``."""
        if not getattr(self, "in_order", True) and self.num_workers > 0:
            raise ConfigError(
                "state_dict() needs in_order=True: out of order, the batches yielded are not a prefix"
            )
        return self.progress.state_dict()

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Make the next epoch this loader begins resume ``state``'s: same order, minus the samples
        already read (which are not fetched again), and the same augmentation draws. This loader may
        have another batch size; at another world size, the sampler a ``DistributedSampler``, an
        :class:`~blobdata.ElasticDistributedSampler` or a :class:`~blobdata.PartitionedSampler`.

        A state saved over another dataset URL, listing (keys, object identities, sizes, classes),
        or sampler is refused with a :class:`~blobdata.ConfigError` naming what differs;
        ``strict=False`` loads it anyway, with a warning, except mid-epoch where its order would
        differ (another number of samples, sampler kind, seed, ``shuffle``, ``drop_last``): that is
        refused whatever ``strict``. A state of version 1 (blobdata 0.2.0 before it recorded the run)
        records none of these: it is loaded with a warning. See ``docs/resume.md``."""
        self.progress.load_state_dict(state, strict=strict)
        if self.device_pipeline is not None and self.progress.seed is not None:
            self.device_pipeline.seed = self.progress.seed


def widen_result_pipe(iterator: Any, size: int = RESULT_PIPE_BYTES) -> None:
    """Give the pipe through which ``iterator``'s workers send their batches (a DataLoader's
    multiprocessing iterator; other iterators have none) a capacity of ``size`` bytes, where the
    kernel allows it: see :data:`RESULT_PIPE_BYTES`. Two system calls per iterator, none per batch."""
    reader = getattr(getattr(iterator, "_worker_result_queue", None), "_reader", None)
    get_size, set_size = getattr(fcntl, "F_GETPIPE_SZ", None), getattr(fcntl, "F_SETPIPE_SZ", None)
    if reader is None or set_size is None or get_size is None:  # not Linux: the pipe keeps its size
        return
    with contextlib.suppress(OSError, ValueError):  # EPERM: the user's allowance, pipe-max-size
        fd = reader.fileno()
        if fcntl.fcntl(fd, get_size) < size:
            fcntl.fcntl(fd, set_size, size)


def _present(batches: Iterator[Any]) -> Iterator[Any]:
    return (batch for batch in batches if batch is not None)


class _FirstBatches:
    """Workers that do not outlive the epoch: near its end, the training process fetches the next
    epoch's first two batches of each worker, which the workers it forks then find in their copy of
    the dataset; see ``docs/resume.md``. Not what a node cache keeps: the epoch's fetches are offered
    to it, and the next epoch's workers read them there (fetching them again here, before this epoch's
    own fetch of the same objects had reached the cache, would double their requests). With peers, the
    objects homed on other nodes are not kept here: those samples are handed over."""

    def __init__(self, dataset: Any, workers: int, context: Any) -> None:
        self.dataset = dataset
        self.workers = workers
        self.context = context  # DataLoader's multiprocessing_context argument

    def begin(self) -> None:
        self.dataset._drop_handoff()

    def end(self, batches: Sequence[Sequence[int]]) -> None:
        if _start_method(self.context) != "fork":
            return  # a spawned worker gets a pickled dataset: nothing handed over reaches it
        first = self.dataset._not_kept([i for batch in batches[: 2 * self.workers] for i in batch])
        if first:
            self.dataset._hand_over(first)


def _start_method(context: Any) -> str:
    if isinstance(context, str):
        return context
    if context is not None:
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


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

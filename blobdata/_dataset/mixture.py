"""``Mixture``: several datasets served as one stream, each source's share of every epoch fixed by its
weight (the plan: :mod:`blobdata._sampling.mixing`; the sampler: :class:`~blobdata.MixtureSampler`).

The mixture's indices are its sources' side by side: source ``k``'s sample ``j`` is index
``offsets[k] + j``. A batch of the planned order is split by source: the look-ahead (one, along the
mixed order, within the largest of the sources' bounds) fetches each sample through its source's own
read path (its store's engine, with its own concurrency and throttle state, and its cache), and marks
what a source's cache holds, and a local disk's files, for the batch to read itself; the batch reads
those per source without the loop (:mod:`blobdata._dataset.reads`), and each source makes its samples
(its decode, its transform) from its local indices. Each source's work is counted in records of its own
(:func:`blobdata._metrics.stats.counting_for`), so ``loader.stats().sources`` has its figures.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from .._config import FetchOptions
from .._errors import ConfigError
from .._fetch import IN_FLIGHT, PlanChannel
from .._metrics import stats as _stats
from .._sampling import checked_weights, listing_digest, source_key
from .base import BlobDatasetBase
from .loader import BlobLoader
from .reads import PENDING, read_direct, take_handed, take_staged

__all__ = ["Mixture"]

#: The key a dict sample gets with ``with_source=True`` (a tuple sample gets the source last).
SOURCE_KEY = "source"


class Mixture(BlobDatasetBase, torch.utils.data.Dataset[Any]):
    """Several datasets (``sources``: names to :class:`~blobdata.FolderDataset` or
    :class:`~blobdata.BlobDataset`, each with its own store, ``storage_options``, ``transform`` and
    cache) read as one stream, each source's share of every epoch set by ``weights`` (names to numbers
    >= 0, normalised; 0 leaves a source out).

    An epoch is an exact plan (see :mod:`blobdata._sampling.mixing`): ``samples_per_epoch`` samples
    (default: the sum of the sizes of the sources with a positive weight), each source's count the
    largest-remainder rounding of its weight times that, its draws without replacement cycling a
    permutation of its samples (each read ``floor`` or ``ceil`` of count/size times), the sources
    interleaved evenly, so that every batch follows the weights. The order depends only on ``seed``,
    the epoch, the weights and the sources' names and sizes: the same for any number of workers.

    A sample is its source's sample unchanged. ``with_source=True`` adds the source's number (its place
    in :attr:`names`): a tuple sample gets it last (``(image, target, source)``, which
    ``default_collate`` makes a tensor of the batch's sources, for per-source losses), a dict sample
    under ``"source"``, anything else becomes ``(sample, source)``; on the device path the targets are
    ``(target, source)`` pairs.

    ``reweight_on_resume=True``: a loader state saved with other weights resumes with these (as
    ``load_state_dict(state, strict=False)`` does, for frameworks that call it themselves, such as
    Lightning). Read it through :meth:`dataloader`; ``blobdata.warm(mix)`` warms every source.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float],
        *,
        samples_per_epoch: int | None = None,
        seed: int = 0,
        with_source: bool = False,
        reweight_on_resume: bool = False,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ConfigError("Mixture(sources, weights): sources must map names to datasets, and name one")
        for name, src in sources.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"source names must be non-empty strings, got {name!r}")
            if isinstance(src, Mixture) or not isinstance(src, BlobDatasetBase):
                got = type(src).__name__
                raise ConfigError(f"source {name!r} must be a FolderDataset or a BlobDataset, got {got}")
            if len(src) == 0:
                raise ConfigError(
                    f"source {name!r} ({src._url}) has no samples: a mixture reads no empty source"
                )
        self.names: tuple[str, ...] = tuple(sources)
        self.weight_tuple = checked_weights(self.names, weights)
        self._sources: list[Any] = [sources[n] for n in self.names]
        self.source_sizes: tuple[int, ...] = tuple(len(s) for s in self._sources)
        self.source_keys: tuple[int, ...] = tuple(source_key(n) for n in self.names)
        self._offsets = [0, *np.cumsum(self.source_sizes).tolist()]
        self._bounds = np.asarray(self._offsets, dtype=np.int64)
        if samples_per_epoch is None:
            samples_per_epoch = sum(n for n, w in zip(self.source_sizes, self.weight_tuple, strict=True) if w)
        if (
            isinstance(samples_per_epoch, bool)
            or not isinstance(samples_per_epoch, (int, np.integer))
            or (samples_per_epoch < 1)
        ):
            raise ConfigError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ConfigError(f"seed must be an integer, got {seed!r}")
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed = int(seed)
        self.with_source = bool(with_source)
        self.reweight_on_resume = bool(reweight_on_resume)
        # What the base machinery reads of a dataset: the mixture itself fetches nothing (its sources do).
        self._url = "mixture:" + ",".join(
            f"{n}={s._url}" for n, s in zip(self.names, self._sources, strict=True)
        )
        self._local_root = None
        self._protocol = "mixture"
        self._storage_options = {}
        self.cache = None
        self.fetch_options = FetchOptions()
        self.on_error = "skip" if all(s.on_error == "skip" for s in self._sources) else "raise"
        self.lookahead = max(s.lookahead for s in self._sources)
        self.lookahead_bytes = max(s.lookahead_bytes for s in self._sources)
        self.list_requests = sum(int(getattr(s, "list_requests", 0)) for s in self._sources)
        self.errors = []
        self._channel: PlanChannel | None = None
        self._handoff = {}
        self._proc = None
        self._ids: list[dict[str, Any]] | None = None
        self._last: tuple[list[int], list[tuple[int, list[int], list[int]]]] | None = None
        self._waits: dict[int, float] = {}

    # -- what it is --------------------------------------------------------------------------------
    @property
    def sources(self) -> Mapping[str, Any]:
        """The sources by name (read-only)."""
        return types.MappingProxyType(dict(zip(self.names, self._sources, strict=True)))

    @property
    def weights(self) -> dict[str, float]:
        """The weights by name, as given."""
        return dict(zip(self.names, self.weight_tuple, strict=True))

    def __len__(self) -> int:
        """The mixture's index space: every source's samples side by side (not an epoch's length)."""
        return int(self._offsets[-1])

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {w:g}" for n, w in self.weights.items())
        return f"Mixture({{{parts}}}, samples_per_epoch={self.samples_per_epoch}, seed={self.seed})"

    def source_of(self, index: int) -> tuple[str, int]:
        """``(source name, the source's own index)`` of the mixture's index ``index``."""
        if not 0 <= int(index) < len(self):
            raise IndexError(f"index {index} out of range for the mixture's {len(self)} samples")
        k = bisect.bisect_right(self._offsets, int(index)) - 1
        return self.names[k], int(index) - self._offsets[k]

    def source_identities(self) -> list[dict[str, Any]]:
        """Each source's name, URL, number of samples and a digest of its listing (what a loader state
        of this mixture records, and checks on resume)."""
        if self._ids is None:
            self._ids = [
                {"name": n, "url": s._url, "samples": len(s),
                 "listing": listing_digest(s.manifest) if getattr(s, "manifest", None) is not None else None}
                for n, s in zip(self.names, self._sources, strict=True)
            ]  # fmt: skip
        return self._ids

    def _stats_sources(self) -> list[tuple[str, int]]:
        """(name, LIST requests of its listing) of each source, for ``loader.stats().sources``."""
        return [
            (n, int(getattr(s, "list_requests", 0))) for n, s in zip(self.names, self._sources, strict=True)
        ]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_last"], state["_waits"] = None, {}
        return state

    # -- reading -----------------------------------------------------------------------------------
    def _split(self, idx: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
        """The batch ``idx`` by source: (source number, positions in the batch, the source's indices)."""
        arr = np.asarray(idx, dtype=np.int64)
        ks = np.searchsorted(self._bounds, arr, side="right") - 1
        out = []
        for k in np.unique(ks).tolist():
            pos = np.flatnonzero(ks == k)
            out.append((k, pos.tolist(), (arr[pos] - self._offsets[k]).tolist()))
        return out

    def _locate(self, i: int) -> tuple[int, int]:
        k = bisect.bisect_right(self._offsets, i) - 1
        return k, i - self._offsets[k]

    def _fetched(self, indices: list[int], seed: int | None = None) -> list[Any]:
        """What the batch reads: each source's cache hits and local files read here, in its own read
        path, the rest fetched on the loop through its source; the waits counted per source."""
        t = time.perf_counter()
        proc = self._process()
        self._waits = {}
        if self._handoff:  # a new worker's first batch: what was fetched for it becomes its own
            self._adopt_handoff(proc)
        datas = take_staged(proc, indices)
        if proc.handed:
            take_handed(proc, indices, datas)
        split = self._split(indices)
        self._last = (indices, split)
        for k, pos, local in split:
            sub = [datas[p] for p in pos]
            if not any(d is PENDING for d in sub):
                continue
            src = self._sources[k]
            t1 = time.perf_counter()
            with _stats.counting_for(k):
                read_direct(src, src._process(), local, sub)
                _stats.rec()[_stats.FETCH_WAIT_S] += time.perf_counter() - t1
            for p, d in zip(pos, sub, strict=True):
                datas[p] = d
        self._read_rest(
            proc, indices, seed, datas, [j for j, d in enumerate(datas) if d is PENDING or d is IN_FLIGHT]
        )
        for k, waited in self._waits.items():
            with _stats.counting_for(k):
                _stats.rec()[_stats.FETCH_WAIT_S] += waited
        _stats.rec()[_stats.FETCH_WAIT_S] += time.perf_counter() - t
        return datas

    async def _await_all(self, indices: list[int], tasks: list[asyncio.Future[Any]]) -> list[Any]:
        """The tasks' results, noting how long the batch waited for each source's last one."""
        t0 = time.perf_counter()
        done: dict[int, float] = {}

        def finished(k: int) -> Callable[[Any], None]:
            def note(_: Any) -> None:
                done[k] = time.perf_counter()

            return note

        for i, task in zip(indices, tasks, strict=True):
            task.add_done_callback(finished(self._locate(i)[0]))
        # Each task's callbacks run in the order added: those above before gather's own.
        out = list(await asyncio.gather(*tasks, return_exceptions=True))
        self._waits = {k: max(0.0, at - t0) for k, at in done.items()}
        return out

    def _make(self, idx: list[int], datas: list[Any], seed: int | None, stop: Any = None) -> list[Any]:
        """Each source makes its samples from its local indices (its decode, its transform), counted as
        its own; the batch keeps the mixed order (a skipped sample's place goes to its source's next)."""
        last = self._last
        split = last[1] if last is not None and last[0] is idx else self._split(idx)
        self._last = None
        out: list[Any] = [None] * len(idx)
        keep = [False] * len(idx)
        for k, pos, local in split:
            src = self._sources[k]
            before = len(src.errors)
            with _stats.counting_for(k):
                made = src._make(local, [datas[p] for p in pos], seed, stop)
                _stats.rec()[_stats.SERVED] += len(made)
            if len(src.errors) > before:  # skipped (on_error="skip"): the mixture's errors say so too
                self.errors.extend(src.errors[before:])
            for p, sample in zip(pos, made, strict=False):
                out[p], keep[p] = self._tag(sample, k), True
        return [s for s, kept in zip(out, keep, strict=True) if kept]

    def _tag(self, sample: Any, k: int) -> Any:
        if not self.with_source:
            return sample
        if self._raw:  # the device path's (bytes, url, target): the target carries the source
            image, url, target = sample
            return image, url, (target, k)
        if isinstance(sample, tuple):
            return (*sample, k)
        if isinstance(sample, dict):
            return {**sample, SOURCE_KEY: k}
        return sample, k

    async def _load(self, i: int, *, checked: bool = False) -> Any:
        k, j = self._locate(i)
        _stats.count_for(k)  # this task's counts (GETs, cache reads) are the source's
        return await self._sources[k]._load(j, checked=checked)

    def _size_of(self, i: int) -> int:
        k, j = self._locate(i)
        return int(self._sources[k]._size_of(j))

    def _cached(self, indices: list[int]) -> list[bool]:
        """Whether the batch reads each sample itself: its source's cache has it (one lookup per
        source), or its source is a local disk read without a look-ahead."""
        out = [False] * len(indices)
        for k, pos, local in self._split(indices):
            src = self._sources[k]
            if src.lookahead <= 0:
                found = [True] * len(local)
            elif src.cache is not None:
                with _stats.counting_for(k):
                    found = src._cached(local)
            else:
                continue
            for p, f in zip(pos, found, strict=True):
                out[p] = f
        return out

    def _not_kept(self, indices: list[int]) -> list[int]:
        out: set[int] = set()
        for k, _pos, local in self._split(indices):
            out.update(self._offsets[k] + j for j in self._sources[k]._not_kept(local))
        return [i for i in indices if i in out]

    def _marks_present(self) -> bool:
        return any(s.cache is not None or s.lookahead <= 0 for s in self._sources)

    def _raw_view(self) -> Mixture:
        """This mixture for the device path: each source's raw view (see ``FolderDataset._raw_view``)."""
        view = copy.copy(self)
        view._sources = [s._raw_view() for s in self._sources]
        view.errors = self.errors
        view._raw = True
        return view

    # -- loaders -----------------------------------------------------------------------------------
    def dataloader(
        self,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        device: str | torch.device | None = None,
        gpu_transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> BlobLoader:
        """A :class:`~blobdata.BlobLoader` over the mixture's planned order: a
        :class:`~blobdata.MixtureSampler` (this rank's part of each epoch; ``shuffle=False`` reads each
        source in index order), or with ``sampler="partitioned"`` one where each node reads its own
        shares of every source (node caches add up). Other arguments are DataLoader's and
        :meth:`FolderDataset.dataloader`'s (``num_workers``, ``device=``, ``gpu_transform=`` ...). The
        loader moves the sampler's epoch on each time it is iterated, unless ``set_epoch`` is called."""
        from .._sampling import MixtureSampler

        given = kwargs.get("sampler")
        if kwargs.get("batch_sampler") is None and (given is None or isinstance(given, str)):
            if given not in (None, "partitioned"):
                raise ConfigError(f'sampler= takes a sampler or "partitioned", got {given!r}')
            sampler = MixtureSampler(self, shuffle=shuffle is not False, by_node=given == "partitioned")
            sampler.owned_by_loader = True
            kwargs["sampler"], shuffle = sampler, None
        return super().dataloader(batch_size, shuffle, device=device, gpu_transform=gpu_transform, **kwargs)

    def _attach(self, channel: PlanChannel) -> None:
        super()._attach(channel)
        for src in self._sources:
            src._channel = channel  # a source's skipped samples reach the loader's errors

    def close(self) -> None:
        """Drop this process's staged data, and each source's handles."""
        super().close()
        for src in self._sources:
            src.close()

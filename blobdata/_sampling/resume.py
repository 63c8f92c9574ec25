"""Runs that stop: the loader's position as a small JSON-friendly state, and a sampler for elastic resume.

:class:`Progress` follows one :class:`~blobdata.BlobLoader`: the epochs it began, the batches it yielded
in the current one, and the sampler's state *at the start* of that epoch (a ``torch.Generator``'s
state in base64, or a ``DistributedSampler``'s seed and epoch; never a list of indices). Loading a
state makes the next epoch the loader begins replay the interrupted epoch's order from that start
state and drop the batches already yielded, before the plan is published, so that workers' look-ahead
starts at the resumed position and nothing already trained on is fetched again.

Elastic resume (:class:`ElasticDistributedSampler`): an epoch's order is one global permutation
(seeded by ``seed + epoch``, the same on every rank: ``DistributedSampler``'s), dealt to the ranks
round-robin: rank ``r`` of ``W`` reads positions ``r, r + W, r + 2W, ...``. When all ranks step in
lockstep, after ``b`` batches of ``B`` samples the ranks together have read exactly the first
``b * B * W`` positions, whatever ``W`` is. The state records that global position; a run that comes
back with ``M`` ranks deals the rest of the permutation round-robin to its ``M`` ranks, so each
remaining sample is seen once (the tail is padded or cut to a multiple of ``M`` as
``DistributedSampler`` does). This is MosaicML streaming's idea (the sample order is fixed by the
job's canonical layout, not by the number of ranks it runs on) and LitData's elastic resume (the
consumed prefix is counted globally), applied to a plain permutation of a bucket folder's listing.
"""

from __future__ import annotations

import base64
import binascii
import copy
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

from .._errors import ConfigError
from .._listing import dist_info
from .identity import ServedDigest, differences
from .keyed import permute, round_keys
from .partition import PartitionedSampler
from .rng import epoch_seed

__all__ = ["STATE_VERSION", "ElasticDistributedSampler", "Progress", "node_share", "own_generator"]

STATE_VERSION = 2  # 2: with the run's identity, the digest of the indices served and the augmentation seed
_ELASTIC = 5  # the salt of the keyed global order (shares.py uses 1-4)


class ElasticDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler``'s order, resumable at another world size (see the module docstring).

    With ``start == 0`` it yields exactly what ``DistributedSampler`` with the same arguments yields.
    ``num_replicas`` and ``rank`` default to the job's (process group or torchrun's variables).
    ``start`` is the number of positions of the epoch's global order already consumed; a loader's
    ``load_state_dict`` sets it, and ``set_epoch`` to another epoch resets it to 0.

    ``permutation``: ``"torch"`` (default) is ``DistributedSampler``'s ``torch.randperm`` of the whole
    dataset on every rank (8 bytes a sample, e.g. 800 MB per rank at 100 M samples); ``"keyed"`` is a
    keyed permutation (:mod:`blobdata._sampling.keyed`, fixed by ``seed`` and the epoch) evaluated at
    this rank's positions only: O(its share) time and memory, another order than ``DistributedSampler``'s
    (a loader state saved with one does not resume with the other).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        permutation: str = "torch",
    ) -> None:
        if permutation not in ("torch", "keyed"):
            raise ConfigError(
                f'ElasticDistributedSampler: permutation must be "torch" or "keyed", got {permutation!r}'
            )
        info = dist_info() if num_replicas is None or rank is None else None
        super().__init__(
            dataset,
            num_replicas=num_replicas if num_replicas is not None else info.world_size,  # type: ignore[union-attr]
            rank=rank if rank is not None else info.rank,  # type: ignore[union-attr]
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.permutation = permutation
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def _at(self, positions: np.ndarray) -> np.ndarray:
        """The epoch's global order at ``positions`` (int64)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return positions
        if self.permutation == "keyed":
            return permute(positions, n, round_keys(self.seed, self.epoch, _ELASTIC))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g)
        return perm[torch.from_numpy(positions)].numpy()

    def global_order(self) -> list[int]:
        """The epoch's global order (unpadded), the same on every rank (O(n): for inspection)."""
        order: list[int] = self._at(np.arange(len(self.dataset), dtype=np.int64)).tolist()  # type: ignore[arg-type]
        return order

    def _per_rank(self, remaining: int) -> int:
        w = self.num_replicas
        return remaining // w if self.drop_last else math.ceil(remaining / w)

    def __len__(self) -> int:
        return self._per_rank(max(0, len(self.dataset) - self.start))  # type: ignore[arg-type]

    def indices(self) -> np.ndarray:
        """This rank's samples for the current epoch, in the order ``__iter__`` yields them (int64): the
        rest of the global order from ``start``, dealt round-robin, its tail padded by repeating its
        start (as ``DistributedSampler`` does) or cut (``drop_last``)."""
        rest = max(0, len(self.dataset) - self.start)  # type: ignore[arg-type]
        total = self._per_rank(rest) * self.num_replicas
        mine = np.arange(self.rank, total, self.num_replicas, dtype=np.int64)
        return self._at(self.start + mine % max(rest, 1))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def node_share(
    n: int, *, nnodes: int, node_rank: int, nproc_per_node: int, seed: int, epoch: int
) -> list[int]:
    """The samples the ranks of node ``node_rank`` read in ``epoch`` under an
    :class:`ElasticDistributedSampler` (or ``DistributedSampler``) with ``seed``, over ``n`` samples;
    torchrun numbers a node's ranks ``node_rank * nproc_per_node + local_rank``."""
    world = nnodes * nproc_per_node
    out: list[int] = []
    for rank in range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node):
        sampler = ElasticDistributedSampler(_Sized(n), num_replicas=world, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        out.extend(sampler)
    return out


def own_generator() -> torch.Generator:
    """A generator for ``shuffle=True`` without one, seeded from torch's global RNG (so
    ``torch.manual_seed`` still fixes the order) and whose state a loader can save."""
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator().manual_seed(seed)


def _encode(gen: torch.Generator) -> str:
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")


def _decode(text: Any) -> torch.Tensor:
    try:
        raw = base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("loader state: the generator state is not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def capture(sampler: Any) -> dict[str, Any]:
    """The sampler's state needed to replay its next epoch (JSON-friendly)."""
    if isinstance(sampler, PartitionedSampler):
        return sampler.loader_state()
    if isinstance(sampler, ElasticDistributedSampler):
        state = {"kind": "elastic", "seed": sampler.seed, "epoch": sampler.epoch, "start": sampler.start}
        return state if sampler.permutation == "torch" else {**state, "permutation": sampler.permutation}
    if isinstance(sampler, DistributedSampler):
        return {"kind": "distributed", "seed": sampler.seed, "epoch": sampler.epoch}
    gen = getattr(sampler, "generator", None)
    if isinstance(gen, torch.Generator):
        return {"kind": "generator", "state": _encode(gen)}
    return {"kind": "sequential" if isinstance(sampler, torch.utils.data.SequentialSampler) else "other"}


class Progress:
    """Where one loader stands; see the module docstring. Lives in the main process only."""

    def __init__(
        self,
        sampler: Any,
        batch_size: int | None,
        seed: int | None = None,
        identity: Callable[[str], dict[str, Any]] | None = None,
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.seed = seed  # the augmentation's (blobdata._sampling.rng); None: not keyed
        self._identity_of = identity  # (sampler kind) -> the run's identity (blobdata._sampling.identity)
        self._identity: dict[str, Any] | None = None
        self.served = ServedDigest()  # every batch handed out, over the epochs
        self._plan: Sequence[Sequence[int]] | None = None  # the current epoch's batches, as planned
        self.epoch = -1  # epochs begun, minus one
        self.batches = 0  # batches yielded in the current epoch, those skipped on resume included
        self.last_size = -1  # samples in the last batch yielded, as planned (-1: not known)
        self.complete = True
        self._start: dict[str, Any] | None = None  # the sampler's state when the current epoch began
        self._pending: tuple[dict[str, Any], int] | None = None  # (sampler state, batches to skip)
        self._loaded: dict[str, Any] | None = None  # the state loaded, until its epoch begins
        self._at_iter: dict[str, Any] | None = None  # the sampler's state at iter(), before the seed draw
        # An elastic sampler leaves out what a resumed epoch had consumed: the batches that were.
        self._resumed = 0
        self._elastic_resume = False
        # A sampler the loader made (dataloader(sampler="partitioned")): its epoch and set_epoch calls
        # when the last epoch began, to move it on when nobody called set_epoch since.
        self._owned_at: tuple[int, int] | None = None

    def at_iter(self) -> None:
        """Called when the loader's iterator is made, before DataLoader draws its base seed."""
        if self._pending is None:
            self._next_owned_epoch()
            self._at_iter = capture(self.sampler)

    def _next_owned_epoch(self) -> None:
        """A sampler the loader made itself is the loader's to move on: each epoch is the next one
        unless ``set_epoch`` was called since the last began (as a loop written for a
        ``DistributedSampler`` does; its epochs are kept)."""
        owned, began = getattr(self.sampler, "owned_by_loader", False), self._owned_at
        if owned and began is not None and self.sampler._set_epoch_calls == began[1]:
            self.sampler.set_epoch(began[0] + 1)

    def begin(self) -> int:
        """Called just before the sampler is iterated for an epoch; returns the batches to skip."""
        skip = 0
        self._at_iter = None
        if self._pending is not None:
            (state, skip), self._pending = self._pending, None
            self._loaded = None
            if state["kind"] == "generator":
                self.sampler.generator.set_state(_decode(state["state"]))
        else:
            self.epoch += 1
            if self._elastic_resume:  # the resumed epoch is over: this one is whole again
                _forget_consumed(self.sampler)
            self._resumed, self._elastic_resume = 0, False
        self._start = capture(self.sampler)
        self.batches, self.complete = skip + self._resumed, False
        if getattr(self.sampler, "owned_by_loader", False):
            self._owned_at = (int(self.sampler.epoch), self.sampler._set_epoch_calls)
        return skip

    def sample_seed(self) -> int | None:
        """The seed the current epoch's augmentation draws are keyed by (with each sample's URL)."""
        return None if self.seed is None else epoch_seed(self.seed, self.epoch)

    def next_sample_seed(self) -> int | None:
        """The seed of the next epoch's draws, unless a state is loaded before it begins."""
        return None if self.seed is None else epoch_seed(self.seed, self.epoch + 1)

    def resumed_batches(self) -> int:
        """Batches of the current epoch an elastic or partitioned sampler leaves out (``len()``
        counts them)."""
        if self._elastic_resume and _leaves_out(self.sampler):
            return self._resumed
        return 0

    def planned(self, batches: Sequence[Sequence[int]]) -> None:
        """The batches the epoch begun will hand out (after those a resume skips), in order."""
        self._plan = batches

    def track(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches, counted (and their indices digested) as they are handed out."""
        for j, batch in enumerate(batches):
            self.batches += 1
            plan = self._plan  # set when the sampler began the epoch, before its first batch
            if plan is not None and j < len(plan):
                self.served.update(self.epoch, plan[j])
                self.last_size = len(plan[j])
            else:
                self.last_size = -1  # not known here
            yield batch
        self.complete = True

    def identity(self) -> dict[str, Any] | None:
        """What identifies this run (computed once: it digests the listing)."""
        if self._identity is None and self._identity_of is not None:
            self._identity = self._identity_of(capture(self.sampler)["kind"])
        return self._identity

    def world_size(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, Any]:
        if self._loaded is not None:  # loaded, its epoch not begun: the same position (as StatefulDataLoader)
            return {**copy.deepcopy(self._loaded), **self._own()}
        complete = self.complete or self._start is None
        if not complete:
            sampler = dict(self._start or {})
        elif self._at_iter is not None:  # between iter() and the epoch's first batch
            sampler = dict(self._at_iter)
        else:
            sampler = capture(self.sampler)
        if sampler["kind"] == "elastic" and not complete:
            n = len(self.sampler.dataset)
            done = (self.batches - self._resumed) * (self.batch_size or 1) * self.world_size()
            sampler["start"] = min(n, sampler["start"] + done)
        if sampler["kind"] == "partitioned" and not complete:
            per_rank = (self.batches - self._resumed) * (self.batch_size or 1)
            sampler = self.sampler.state_after(sampler, per_rank)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": 0 if complete else self.batches,
            "complete": complete,
            "batch_size": self.batch_size,
            "world_size": self.world_size(),
            "sampler": sampler,
            **self._own(),
        }

    def _own(self) -> dict[str, Any]:
        """What this loader's state says of the run, whatever state it loaded."""
        return {
            "version": STATE_VERSION,
            "run": self.identity(),
            "served": self.served.state(),
            "seed": self.seed,  # the augmentation's: a resumed run draws the same crops
        }

    def load_state_dict(self, state: Any, *, strict: bool = True) -> None:
        if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"not a blobdata loader state of version 1 or {STATE_VERSION} (got {got!r})")
        self._check_run(state, strict)
        try:
            saved, epoch, batches = dict(state["sampler"]), int(state["epoch"]), int(state["batches"])
            complete = bool(state["complete"])
            saved_world = int(state["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"blobdata loader state is missing or has a bad field: {exc}") from None
        here = capture(self.sampler)
        if saved.get("kind") != here["kind"]:
            raise ConfigError(
                f"the loader state was saved with a {saved.get('kind')} sampler; "
                f"this loader's is {here['kind']}"
            )
        kind = here["kind"]
        if kind in ("elastic", "distributed"):
            if int(saved["seed"]) != self.sampler.seed and strict:
                raise ConfigError(
                    f"the state's sampler seed is {saved['seed']}, this sampler's {self.sampler.seed}"
                )
            was, now = saved.get("permutation", "torch"), here.get("permutation", "torch")
            if was != now:
                raise ConfigError(
                    f"the state was saved with an ElasticDistributedSampler of permutation={was!r}, this "
                    f"one has {now!r}: its order would differ, so it cannot resume there"
                )
            self.sampler.set_epoch(int(saved["epoch"]))
        self._resumed, self._elastic_resume = 0, False
        if kind == "partitioned":
            self.sampler.load_loader_state(saved, complete=complete)
            if not complete:  # the sampler leaves out what was consumed, at any layout
                self._resumed, self._elastic_resume = batches, True
            batches = 0
        elif kind == "elastic":
            self.sampler.start = 0 if complete else int(saved["start"])
            if not complete:  # the sampler itself leaves out what was consumed, at any world size
                self._resumed, self._elastic_resume = batches, True
            batches = 0
        elif not complete:
            if saved_world != self.world_size():
                raise ConfigError(
                    f"the state was saved at world size {saved_world}, this is {self.world_size()}: resume "
                    "at another world size needs blobdata.ElasticDistributedSampler"
                )
            if state.get("batch_size") != self.batch_size and strict:
                raise ConfigError(
                    f"the state was saved with batch_size={state.get('batch_size')}, this loader has "
                    f"{self.batch_size}"
                )
        if kind == "generator" and complete:
            self.sampler.generator.set_state(_decode(saved["state"]))
        if state.get("seed") is not None:
            self.seed = int(state["seed"])
        self.served = ServedDigest.from_state(state.get("served"))
        self.epoch = epoch
        self.batches, self.complete = 0, True
        self._start = self._at_iter = None
        self._pending = None if complete else (saved, batches)
        self._loaded = None if complete else copy.deepcopy(dict(state))


    def _check_run(self, state: dict[str, Any], strict: bool) -> None:
        """Refuse (``strict``) or warn of a state from another dataset, listing, sampler or batch size."""
        if state.get("version") == 1:
            warnings.warn(
                "a blobdata loader state of version 1 (blobdata before 0.3) records no run identity: it is "
                "loaded without checking that it was saved over this dataset, listing, sampler and batch "
                "size, and the digest of the indices served starts again here",
                UserWarning,
                stacklevel=4,
            )
            return
        here = self.identity()
        saved = state.get("run")
        if here is None or not isinstance(saved, dict):
            return
        diffs = differences(saved, here)
        if not diffs:
            return
        text = "; ".join(diffs)
        if strict:
            raise ConfigError(
                f"this loader state was saved by another run ({text}): resuming it here would not continue "
                "that run. Pass strict=False to load_state_dict to load it anyway"
            )
        warnings.warn(f"loading a loader state of another run ({text}), as strict=False asks", UserWarning,
                      stacklevel=4)  # fmt: skip


def _leaves_out(sampler: Any) -> bool:
    """Whether ``sampler`` now leaves out the start of a resumed epoch (elastic or partitioned)."""
    if isinstance(sampler, PartitionedSampler):
        return bool(sampler.consumed)
    return getattr(sampler, "start", 0) > 0


def _forget_consumed(sampler: Any) -> None:
    """The resumed epoch is over: ``sampler`` yields whole epochs again."""
    if isinstance(sampler, PartitionedSampler):
        sampler.consumed = []
    elif isinstance(sampler, ElasticDistributedSampler):
        sampler.start = 0

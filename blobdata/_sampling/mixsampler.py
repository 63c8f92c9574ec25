""":class:`MixtureSampler`: a :class:`~blobdata.Mixture`'s epochs as exact plans
(:mod:`blobdata._sampling.mixing`), dealt to the job's ranks in blocks, resumable.

Two ways to deal an epoch to ranks:

* **global** (default): the epoch's one order of ``N`` positions, rank ``r`` of ``W`` reading block
  ``r`` (``ceil(N / W)`` positions, padded by repeating the start as ``DistributedSampler`` pads, or
  ``floor(N / W)`` with ``drop_last``). The ranks together read the epoch once. A loader state records
  what each run read (``W`` ranks, ``p`` samples each): a run resumed at another world size deals the
  rest in blocks to its ranks, each remaining sample once.
* **by node** (``by_node=True``, ``dataloader(sampler="partitioned")``): each node reads its own share
  of every source every epoch (:func:`blobdata._sampling.shares.node_share`, as
  :class:`~blobdata.PartitionedSampler` does), so node caches add up. Node ``j`` plans its part of the
  epoch (``N / nnodes`` positions, to within one) with the same weights over its shares, and its ranks
  read it in blocks, every rank of the job ``ceil(N / W)`` samples (padding from the node's own part).
  A source smaller than the number of nodes is not split. Mid-epoch, a state resumes at the same
  layout only.

Weights: a state saved with other weights loads with ``strict=False`` (or into a mixture made with
``reweight_on_resume=True``): what was read stays read, and the rest of the epoch (the same length)
is planned again with the new weights (:func:`blobdata._sampling.mixing.weighted`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from .._errors import ConfigError
from .._listing import dist_info
from .mixing import Draws, checked_weights, deal, per_rank_of, remaining, weighted
from .shares import node_share

__all__ = ["MixtureSampler"]


class MixtureSampler(DistributedSampler[int]):
    """The planned order of a :class:`~blobdata.Mixture` (see :mod:`blobdata._sampling.mixing`), this
    rank's part of each epoch. ``mix.dataloader()`` makes one; make your own for other settings.

    ``num_replicas`` and ``rank`` default to the job's (the process group, or torchrun's ``RANK`` and
    ``WORLD_SIZE``); ``seed`` to the mixture's. ``shuffle=False`` reads each source in index order (the
    interleave stays even). Call ``set_epoch(e)`` each epoch, as with ``DistributedSampler`` (a loader
    that made its sampler moves it on itself). ``by_node=True``: each node reads its own shares of every
    source (``nproc_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        *,
        by_node: bool = False,
        nproc_per_node: int | None = None,
    ) -> None:
        if not hasattr(dataset, "source_sizes"):
            raise ConfigError(f"MixtureSampler reads a blobdata.Mixture, got {type(dataset).__name__}")
        info = dist_info() if num_replicas is None or rank is None or nproc_per_node is None else None
        world = int(num_replicas if num_replicas is not None else info.world_size)  # type: ignore[union-attr]
        me = int(rank if rank is not None else info.rank)  # type: ignore[union-attr]
        if world < 1 or not 0 <= me < world:
            raise ConfigError(f"MixtureSampler: rank {me} is not in 0..{world - 1} (num_replicas={world})")
        super().__init__(
            dataset, num_replicas=world, rank=me, shuffle=shuffle,
            seed=int(dataset.seed if seed is None else seed), drop_last=drop_last,
        )  # fmt: skip
        per_node = world if not by_node else int(nproc_per_node or info.local_world_size)  # type: ignore[union-attr]
        if per_node < 1 or world % per_node:
            raise ConfigError(
                f"MixtureSampler: {world} ranks cannot sit on nodes of nproc_per_node={per_node} ranks each "
                "(it must divide num_replicas)"
            )
        self.by_node = bool(by_node)
        self.nproc_per_node = per_node
        self.nnodes = world // per_node
        self.node_rank, self.local_rank = divmod(me, per_node)
        self.sizes: tuple[int, ...] = tuple(int(n) for n in dataset.source_sizes)
        self.keys: tuple[int, ...] = tuple(dataset.source_keys)
        self.weights: tuple[float, ...] = tuple(dataset.weight_tuple)
        self.samples_per_epoch = int(dataset.samples_per_epoch)
        #: What earlier runs read of the current epoch: ``(W, p)``, W ranks (a node's, by node) read p each.
        self.consumed: tuple[tuple[int, int], ...] = ()
        #: The weights of each phase of the current epoch (one more than ``consumed``), when resumed.
        self.phase_weights: tuple[tuple[float, ...], ...] | None = None
        self.epoch_samples: int | None = None  # the resumed epoch's length (the state's)
        self.owned_by_loader = False  # made by mix.dataloader(): the loader moves its epoch on
        self._set_epoch_calls = 0
        self._memo: tuple[tuple[Any, ...], np.ndarray] | None = None
        self.num_samples = len(self)
        self.total_size = self.num_samples * world

    # -- the order ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.forget()
        self._set_epoch_calls += 1
        super().set_epoch(epoch)

    def set_weights(self, weights: Any) -> None:
        """New weights from the next epoch begun (a curriculum); the same checks as the mixture's."""
        self.weights = checked_weights(self.dataset.names, weights)  # type: ignore[attr-defined]

    def forget(self) -> None:
        """Whole epochs again: nothing of a resumed epoch left out."""
        self.consumed, self.phase_weights, self.epoch_samples = (), None, None

    def _total(self) -> int:
        return self.samples_per_epoch if self.epoch_samples is None else self.epoch_samples

    def _weights(self) -> tuple[tuple[float, ...], ...]:
        return self.phase_weights if self.phase_weights is not None else (self.weights,)

    def _first(self) -> tuple[int, int, int]:
        """(positions this rank's plan has, ranks that deal it, samples each reads) before any phase."""
        total, w = self._total(), self.num_replicas
        if not self.by_node:
            return total, w, per_rank_of(total, w, self.drop_last)
        k, j = self.nnodes, self.node_rank
        return (
            total // k + (1 if j < total % k else 0),
            self.nproc_per_node,
            per_rank_of(total, w, self.drop_last),
        )

    def _now(self) -> tuple[int, int]:
        """(positions left in this phase, samples each rank reads of them), computed without the plan."""
        n, _, per = self._first()
        for world, read in self.consumed:
            if not self.by_node:
                per = per_rank_of(n, world, self.drop_last)
            left = max(0, per - read)
            n, per = world * left + max(0, n - world * per), left
        return n, per if self.by_node else per_rank_of(n, self.num_replicas, self.drop_last)

    def __len__(self) -> int:
        return self._now()[1]

    def _plan(self) -> np.ndarray:
        """The current phase's order: the epoch's (global), or this node's part of it (by node)."""
        key = (self._total(), self.consumed, self._weights(), self.seed, self.epoch, self.shuffle,
               self.drop_last, self.by_node, self.nnodes, self.node_rank, self.sizes)  # fmt: skip
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
        if self.by_node:
            k, j = self.nnodes, self.node_rank
            pools: list[Any] = [
                node_share(n, seed=self.seed, nnodes=k, node=j) if n >= k else n for n in self.sizes
            ]
        else:
            pools = list(self.sizes)
        draws = Draws(pools, offsets, self.keys, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        n, _, per = self._first()
        weights = self._weights()
        order, sources = weighted(n, weights[0], draws)
        for phase, (world, read) in enumerate(self.consumed, start=1):
            if not self.by_node:
                per = per_rank_of(len(order), world, self.drop_last)
            order, sources = remaining(order, sources, world, per, read)
            per = max(0, per - read)
            if _weights_differ(weights[phase], weights[phase - 1]):  # the rest planned by the new weights
                left = [order[sources == s] for s in range(len(self.sizes))]
                order, sources = weighted(len(order), weights[phase], draws, phase=phase, left=left)
        self._memo = (key, order)
        return order

    def indices(self) -> np.ndarray:
        """This rank's samples for the current epoch (global indices of the mixture), in the order
        ``__iter__`` yields them (int64)."""
        order = self._plan()
        per = self._now()[1]
        me, ranks = (self.local_rank, self.nproc_per_node) if self.by_node else (self.rank, self.num_replicas)
        return order[deal(len(order), ranks, per)[me]] if len(order) else order

    def global_order(self) -> list[int]:
        """The current phase's order (of the whole epoch, or by node this node's part), the same on every
        rank of a node: the ranks read it in blocks (for inspection)."""
        order: list[int] = self._plan().tolist()
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    # -- the loader's state (blobdata._sampling.resume) ----------------------------------------------
    def loader_state(self) -> dict[str, Any]:
        """What replays the current epoch from its start (JSON-friendly)."""
        names = self.dataset.names  # type: ignore[attr-defined]
        weights = self._weights()
        return {
            "kind": "mixture", "seed": self.seed, "epoch": self.epoch, "samples": self._total(),
            "shuffle": self.shuffle, "drop_last": self.drop_last, "by_node": self.by_node,
            "layout": [self.nnodes, self.nproc_per_node], "consumed": [list(c) for c in self.consumed],
            "weights": dict(zip(names, weights[-1], strict=True)),
            "phase_weights": [list(w) for w in weights],
            "sources": self.dataset.source_identities(),  # type: ignore[attr-defined]
        }  # fmt: skip

    def state_after(self, start: dict[str, Any], per_rank: int) -> dict[str, Any]:
        """``start`` (:meth:`loader_state` at the epoch's start) after every rank read ``per_rank`` more."""
        world = self.nproc_per_node if self.by_node else self.num_replicas
        read = max(0, min(int(per_rank), len(self)))
        weights = start["phase_weights"]
        return {
            **start,
            "consumed": [*start["consumed"], [world, read]],
            "phase_weights": [*weights, weights[-1]],
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse (whatever ``strict``) a state saved over other sources, naming each difference."""
        saved = state.get("sampler")
        if not isinstance(saved, dict) or saved.get("kind") != "mixture":
            return
        here = self.dataset.source_identities()  # type: ignore[attr-defined]
        theirs = saved.get("sources")
        if not isinstance(theirs, list):
            raise ConfigError("blobdata loader state: a mixture state without its sources")
        diffs = _source_differences(theirs, here)
        if diffs:
            raise ConfigError(
                f"this loader state was saved over other sources ({'; '.join(diffs)}): a mixture resumes "
                "only a state of the same sources (names, URLs, listings); make the mixture of those, or "
                "start this one afresh"
            )

    def load_loader_state(self, state: dict[str, Any], *, complete: bool, reweight: bool) -> str | None:
        """Make the next iteration resume ``state``'s epoch (the one after it when ``complete``).
        ``reweight``: other weights are taken (the rest of the epoch follows this sampler's); else
        refused. Returns the weights' difference in words, or None."""
        try:
            epoch, total = int(state["epoch"]), int(state["samples"])
            saved = {k: state[k] for k in ("seed", "shuffle", "drop_last", "by_node")}
            layout = [int(x) for x in state["layout"]]
            consumed = tuple((int(w), int(p)) for w, p in state["consumed"])
            weights = tuple(tuple(float(x) for x in w) for w in state["phase_weights"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"blobdata loader state: a bad mixture state ({exc!r})") from None
        s = len(self.sizes)
        if (
            total < 1
            or len(weights) != len(consumed) + 1
            or any(
                len(w) != s or not all(math.isfinite(x) and x >= 0 for x in w) or not any(w) for w in weights
            )
            or any(w < 1 or p < 0 for w, p in consumed)
        ):
            raise ConfigError("blobdata loader state: a bad mixture state (samples, consumed or weights)")
        here = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "by_node": self.by_node,
        }
        for key, value in here.items():
            if saved[key] != value and not (complete and key == "drop_last"):
                raise ConfigError(
                    f"the loader state was saved with a MixtureSampler of {key}={saved[key]!r}, this one has "
                    f"{key}={value!r}: its order would differ, so it cannot resume there"
                )
        if self.by_node and not complete and layout != [self.nnodes, self.nproc_per_node]:
            raise ConfigError(
                f"the loader state was saved mid-epoch by node on {layout[0]} nodes of {layout[1]} ranks; "
                f"this job has {self.nnodes} of {self.nproc_per_node}: a by-node mixture resumes mid-epoch "
                "at the same layout only (or load a state saved at an epoch's end)"
            )
        names = self.dataset.names  # type: ignore[attr-defined]
        changed = _weights_differ(weights[-1], self.weights)
        words = f"weights {_named(names, weights[-1])} in the state, {_named(names, self.weights)} here"
        if changed and not reweight:
            raise ConfigError(
                f"this loader state was saved with other {words}: pass strict=False to load_state_dict, or "
                "make the mixture with reweight_on_resume=True, to resume it with this mixture's weights "
                "(what was read stays read; the rest of its epoch follows the new weights)"
            )
        self.set_epoch(epoch)
        self.forget()
        if not complete:
            self.consumed, self.epoch_samples = consumed, total
            self.phase_weights = (*weights[:-1], self.weights)
        return words if changed else None


def _weights_differ(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    sa, sb = sum(a), sum(b)
    if len(a) != len(b):
        return True
    return any(not math.isclose(x / sa, y / sb, rel_tol=1e-12) for x, y in zip(a, b, strict=True))


def _named(names: Any, weights: tuple[float, ...]) -> str:
    return "{" + ", ".join(f"{n}: {w:g}" for n, w in zip(names, weights, strict=True)) + "}"


def _source_differences(theirs: list[Any], here: list[dict[str, Any]]) -> list[str]:
    """What differs between a state's sources and this mixture's, in words."""
    a = {str(s.get("name")): s for s in theirs if isinstance(s, dict)}
    b = {s["name"]: s for s in here}
    out = [f"source {n!r} is in the state, not in this mixture" for n in a if n not in b]
    out += [f"source {n!r} is in this mixture, not in the state" for n in b if n not in a]
    for n in b:
        if n in a:
            for key, word in (("url", "URL"), ("samples", "number of samples"), ("listing", "listing")):
                if a[n].get(key) != b[n].get(key):
                    out.append(f"source {n!r}: its {word} is {a[n].get(key)!r} there, {b[n].get(key)!r} here")
    if not out and list(a) != list(b):
        out.append(f"the sources' order is {list(a)} there, {list(b)} here")
    return out

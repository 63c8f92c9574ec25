"""Augmentation randomness keyed per sample: draws that depend on (loader seed, epoch, sample URL) only.

A DataLoader worker's torch generator is seeded per worker and per epoch, so a random crop depends on
which worker served the sample and on how many samples that worker transformed before it: a run
resumed mid-epoch, or run with another number of workers, sees other crops. blobdata's loader instead
keys every sample's draws by the loader's seed, the epoch and the sample's URL (the GPU path's
boxes, :meth:`blobdata.gpu.TrainTransform.draw_keyed`, and the CPU path's
:class:`blobdata.transforms.RandomResizedCrop` alike), through a counter-based generator: each value is
a hash of (seed, key, position), so a sample's draws depend on nothing else.

The loader's batch sampler hands each batch to the dataset with the epoch's seed
(:class:`~blobdata._fetch.lookahead.KeyedBatch`); the dataset marks each sample being transformed
(:func:`enter`), and transforms ask :func:`current` for its :class:`SampleDraws`. Users' own
transforms get the same through :func:`sample_rng`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .._errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Keyed", "SampleDraws", "current", "enter", "enter_batch", "epoch_seed", "leave", "loader_seed",
    "sample_key", "sample_rng", "uniforms",
]  # fmt: skip

_MASK = (1 << 64) - 1
_UNIT = 1.0 / (1 << 53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Stream numbers of the generators sample_rng() gives, apart from the crop's counter stream.
_NUMPY_STREAM, _TORCH_STREAM = 1, 2


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a bijective 64-bit hash."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's draws, from a loader's seed and the epoch number."""
    x = np.array([seed & _MASK], dtype=np.uint64) ^ _mix(np.array([epoch & _MASK], dtype=np.uint64))
    return int(_mix(x)[0])


def uniforms(seed: int, keys: np.ndarray, count: int, start: int = 0) -> np.ndarray:
    """``(len(keys), count)`` float64 uniforms in [0, 1): positions ``start .. start + count - 1`` of
    stream ``keys[k]`` of ``seed``, counter-based (each value a hash of (seed, key, position)), so a
    sample's draws depend on nothing else."""
    base = _mix(np.uint64(seed & _MASK) ^ _mix(np.asarray(keys).astype(np.uint64)))
    steps = _GOLDEN * np.arange(start + 1, start + count + 1, dtype=np.uint64)
    bits = _mix(base[:, None] + steps[None, :]) >> np.uint64(11)
    out: np.ndarray = bits.astype(np.float64) * (1.0 / (1 << 53))
    return out


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python int (the same bits)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def loader_seed(generator: torch.Generator | None, sampler: Any = None) -> int:
    """A loader's augmentation seed: its ``generator``'s initial seed; else, under a
    ``DistributedSampler`` (or a subclass), the sampler's seed, the same on every rank (so a sample's
    draws do not depend on the rank that reads it); else one drawn from torch's global generator (so
    ``torch.manual_seed`` fixes it). A loader's state records it."""
    import torch
    from torch.utils.data.distributed import DistributedSampler

    if generator is not None:
        return int(generator.initial_seed())
    if isinstance(sampler, DistributedSampler):
        return int(sampler.seed)
    return int(torch.empty((), dtype=torch.int64).random_().item())


def sample_key(url: str) -> int:
    """A sample's stream number: the CRC-32 of its URL (the GPU path's key)."""
    return zlib.crc32(url.encode())


def _seed_of(seed: int, key: int, stream: int) -> int:
    """A 64-bit seed for generator ``stream`` of sample ``key`` under ``seed``."""
    x = _mix(np.array([(key | (stream << 32)) & _MASK], dtype=np.uint64))
    return int(_mix(np.uint64(seed & _MASK) ^ x)[0])


class SampleDraws:
    """The draws of one sample being transformed: ``seed`` (the epoch's, None outside a blobdata
    loader) and ``url``. Counter-based draws (:meth:`uniforms`) advance a position, so a transform
    applied twice to one sample (two views) draws twice."""

    __slots__ = ("_key", "_numpy", "_torch", "position", "seed", "url")

    def __init__(self, seed: int | None, url: str) -> None:
        # Made for every sample served, drawn from by few: nothing is computed until a draw asks.
        self.seed = seed
        self.url = url
        self._key = -1
        self.position = 0
        self._numpy: np.random.Generator | None = None
        self._torch: torch.Generator | None = None

    @property
    def key(self) -> int:
        """The sample's stream number (:func:`sample_key` of its URL), computed at the first draw."""
        if self._key < 0:
            self._key = sample_key(self.url)
        return self._key

    @property
    def keyed(self) -> bool:
        """Whether the draws come from a loader's (seed, epoch) and the URL (else: torch's global RNG)."""
        return self.seed is not None

    def uniforms(self, count: int) -> np.ndarray:
        """The next ``count`` counter-based uniforms of this sample (a keyed sample only)."""
        if self.seed is None:
            raise ConfigError("SampleDraws.uniforms: not a keyed sample (no loader's seed)")
        out: np.ndarray = uniforms(self.seed, np.array([self.key], dtype=np.uint64), count, self.position)[0]
        self.position += count
        return out

    def _stream_seed(self, stream: int) -> int:
        if self.seed is None:  # ds[i] outside a loader: as torch's global RNG would give
            import torch

            return int(torch.empty((), dtype=torch.int64).random_().item()) & _MASK
        return _seed_of(self.seed, self.key, stream)

    def stream(self, count: int) -> Callable[[int], float]:
        """The next ``count`` counter-based uniforms of this sample, each computed when asked for
        (``u(i)``, ``0 <= i < count``): position for position the values :meth:`uniforms` gives, at a
        microsecond each where a transform needs only a few of them."""
        if self.seed is None:
            raise ConfigError("SampleDraws.stream: not a keyed sample (no loader's seed)")
        base = _mix_int((self.seed & _MASK) ^ _mix_int(self.key))
        start = self.position
        self.position += count
        golden = int(_GOLDEN)

        def u(i: int) -> float:
            return (_mix_int((base + golden * (start + i + 1)) & _MASK) >> 11) * _UNIT

        return u

    def numpy(self) -> np.random.Generator:
        if self._numpy is None:
            self._numpy = np.random.Generator(np.random.Philox(self._stream_seed(_NUMPY_STREAM)))
        return self._numpy

    def torch(self) -> torch.Generator:
        if self._torch is None:
            import torch

            # manual_seed takes a signed 64-bit value or an unsigned one below 2**64.
            self._torch = torch.Generator().manual_seed(self._stream_seed(_TORCH_STREAM))
        return self._torch


class Keyed:
    """The samples of a batch being made in this thread, one at a time: :meth:`sample` says which
    (its URL), and its :class:`SampleDraws` are made at the first draw. One per batch (:func:`enter`),
    so a sample that draws nothing costs two attribute stores."""

    __slots__ = ("_draws", "seed", "url")

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.url: str | None = None
        self._draws: SampleDraws | None = None

    def sample(self, url: str) -> None:
        """The sample ``url`` is being made now (its loader and transforms run)."""
        self.url = url
        self._draws = None

    def draws(self) -> SampleDraws | None:
        """The draws of the sample being made, or None between samples."""
        draws = self._draws
        if draws is None and self.url is not None:
            draws = self._draws = SampleDraws(self.seed, self.url)
        return draws


_current: ContextVar[Keyed | None] = ContextVar("blobdata_sample", default=None)


def current() -> SampleDraws | None:
    """The sample being transformed in this thread, or None."""
    keyed = _current.get()
    return keyed.draws() if keyed is not None else None


def enter_batch(seed: int | None) -> tuple[Keyed, Token[Keyed | None]]:
    """A batch's samples are made in this thread, their draws keyed by the epoch's ``seed`` (None: not
    read through a blobdata loader): :meth:`Keyed.sample` before each sample's loader and transforms,
    then :func:`leave` with the token."""
    keyed = Keyed(seed)
    return keyed, _current.set(keyed)


def enter(seed: int | None, url: str) -> Token[Keyed | None]:
    """One sample, ``url``, is made in this thread (:func:`enter_batch` for a batch of them); then
    :func:`leave` with the token returned."""
    keyed, token = enter_batch(seed)
    keyed.sample(url)
    return token


def leave(token: Token[Keyed | None]) -> None:
    """The batch (or sample) :func:`enter_batch` (:func:`enter`) began is made."""
    _current.reset(token)


def sample_rng(kind: Literal["numpy", "torch"] = "numpy") -> Any:
    """A random generator for the sample being transformed, keyed by the loader's seed, the epoch and
    the sample's URL: the same draws whatever the number of workers, the worker that serves the
    sample, or a resume in between.

    Call it inside a transform of a :class:`~blobdata.FolderDataset` (``transform=`` or
    ``target_transform=``): ``kind="numpy"`` gives a ``numpy.random.Generator``, ``kind="torch"`` a
    ``torch.Generator`` (pass it as ``generator=`` to torch's random functions). Within one sample,
    each call returns the same generator, which goes on drawing: two transforms of one sample draw
    different values. Read through a blobdata loader, the draws are exact across runs with the same
    loader seed; read without one (``ds[i]``, a plain ``DataLoader``), the generator is seeded from
    torch's global RNG. Outside a transform it raises :class:`~blobdata.ConfigError`.

    >>> def jitter(img):
    ...     g = blobdata.sample_rng()
    ...     return img * g.uniform(0.8, 1.2)
    """
    draws = current()
    if draws is None:
        raise ConfigError(
            "blobdata.sample_rng() is for a transform of a FolderDataset while it transforms a sample "
            "(it is keyed by that sample's URL and the loader's seed and epoch); here no sample is being "
            "transformed"
        )
    if kind == "numpy":
        return draws.numpy()
    if kind == "torch":
        return draws.torch()
    raise ConfigError(f"sample_rng(kind=...) takes 'numpy' or 'torch', got {kind!r}")

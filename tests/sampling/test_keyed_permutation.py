"""The keyed permutation the samplers evaluate at their own positions: a permutation of ``0..n-1`` for
every ``n`` (tiny, prime, powers of two and their neighbours), fixed by its key and different across
keys, and uniform: deterministic chi-square checks over thousands of fixed keys (no randomness at run
time, so they cannot flake; a biased network fails them by orders of magnitude)."""

from __future__ import annotations

import numpy as np
import pytest

from blobdata._sampling import permute, round_keys
from blobdata._sampling.keyed import ROUNDS

PRIMES = [2, 3, 5, 7, 11, 13, 31, 61, 127, 251, 509, 1021, 4093, 65521, 1_000_003]


def _is_permutation(p: np.ndarray, n: int) -> bool:
    return len(p) == n and p.dtype == np.int64 and bool((np.bincount(p, minlength=n) == 1).all())


@pytest.mark.parametrize("n", [*range(0, 70), *PRIMES, 1 << 16, (1 << 16) + 1, (1 << 20) - 1, 1 << 20])
def test_every_index_once_for_many_n(n: int) -> None:
    for seed in (0, 1, 2**63 + 5) if n < 100_000 else (2**63 + 5,):
        p = permute(np.arange(n), n, round_keys(seed, 7))
        assert _is_permutation(p, n), (n, seed)
    assert (permute(np.arange(n), n, round_keys(seed, 7)) == p).all()  # fixed by its key


def test_positions_in_any_order_and_any_shape_give_the_same_images() -> None:
    n, keys = 10_007, round_keys(4)
    whole = permute(np.arange(n), n, keys)
    pos = np.array([[17, 0], [n - 1, 5000]])
    assert (permute(pos, n, keys) == whole[pos]).all()
    assert (permute(np.arange(n)[::-1], n, keys) == whole[::-1]).all()
    # A key per element gives what each key alone gives.
    per_key = np.stack([round_keys(s) for s in range(50)], axis=1).repeat(n // 50 + 1, axis=1)[:, :n]
    mixed = permute(np.arange(n), n, per_key)
    for s in (0, 7, 49):
        mine = np.flatnonzero(np.arange(n) // (n // 50 + 1) == s)
        assert (mixed[mine] == permute(mine, n, round_keys(s))).all()
    with pytest.raises(ValueError, match=r"\[0, 10007\)"):
        permute(np.array([n]), n, keys)


@pytest.mark.parametrize("n", [2, 3, 100, 4096, 1_000_003])
def test_different_keys_give_different_permutations(n: int) -> None:
    perms = {tuple(permute(np.arange(min(n, 64)), n, round_keys(seed, epoch)).tolist())
             for seed in range(8) for epoch in range(8)}  # fmt: skip
    if n >= 100:
        assert len(perms) == 64  # every (seed, epoch) its own order
    else:
        assert len(perms) == (2 if n == 2 else 6)  # every permutation of 2 or 3 reached


def _chi2_cells(images: np.ndarray, n: int) -> float:
    """Chi-square of the (position, image) table of ``images`` (one permutation of ``n`` per row)
    against the uniform table."""
    rows = images.shape[0]
    table = np.zeros((n, n), dtype=np.int64)
    np.add.at(table, (np.tile(np.arange(n), rows), images.ravel()), 1)
    expected = rows / n
    return float(((table - expected) ** 2 / expected).sum())


def _many_keys(count: int, n: int) -> np.ndarray:
    """``count`` fixed keys, each repeated for ``n`` positions: shape (ROUNDS, count * n)."""
    return np.repeat(np.stack([round_keys(s, 99) for s in range(count)], axis=1), n, axis=1)


@pytest.mark.parametrize("n", [3, 5, 8, 13, 16, 31, 100])
def test_each_position_is_sent_uniformly(n: int) -> None:
    """Over 4000 keys, where each position lands: chi-square with (n-1)^2 degrees of freedom, bound at
    its mean plus 5 standard deviations (a uniform table exceeds it with odds under 1e-5; these keys
    are fixed, so the test gives the same answer every run)."""
    count = 4000
    images = permute(np.tile(np.arange(n), count), n, _many_keys(count, n)).reshape(count, n)
    assert (np.sort(images, axis=1) == np.arange(n)).all()
    dof = (n - 1) ** 2
    chi2 = _chi2_cells(images, n)
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (n, chi2, dof)


@pytest.mark.parametrize("n", [100, 1000, 65_536, 1_000_003])
def test_neighbouring_positions_are_ordered_at_random(n: int) -> None:
    """The Feistel's weak spot would be positions that differ in a few low bits: for the pairs
    (p, p+1) and (p, p+2^k), each under its own fixed key, how often the first image is the smaller is
    a fair coin (within 5 standard deviations over 20,000 pairs), and the mean gap between the images
    is a random permutation's."""
    count = 20_000
    keys = _many_keys(count, 1)
    starts = (np.arange(count, dtype=np.int64) * 7919) % (n - 32)
    for step in (1, 2, 8, 32):
        a, b = permute(starts, n, keys), permute(starts + step, n, keys)
        smaller = float((a < b).mean())
        assert abs(smaller - 0.5) < 5 * (0.25 / count) ** 0.5, (n, step, smaller)
        # |a - b| / n is about |U - V| for U, V uniform on [0, 1): mean 1/3, sd 0.24.
        gap = float(np.abs(a - b).mean()) / n
        assert abs(gap - 1 / 3) < 5 * 0.24 / count**0.5, (n, step, gap)
    assert keys.shape == (ROUNDS, count)


def test_a_large_permutation_fills_every_decile_of_every_block() -> None:
    """n = 1,000,003 (a prime: cycle-walking on): each block of 100,000 consecutive positions sends
    about a tenth of itself to each tenth of the range (chi-square over the 10 x 10 table)."""
    n = 1_000_003
    p = permute(np.arange(n), n, round_keys(2024))
    blocks = np.arange(n) * 10 // n
    deciles = p * 10 // n
    table = np.zeros((10, 10))
    np.add.at(table, (blocks, deciles), 1)
    expected = np.outer(table.sum(1), table.sum(0)) / n
    chi2 = float(((table - expected) ** 2 / expected).sum())
    assert chi2 < 81 + 5 * (2 * 81) ** 0.5, chi2

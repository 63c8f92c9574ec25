"""Each object's home: rendezvous hashing over the job's node names. A resize moves only what must
move (the homes of a node that left; about 1/N to a node that joined), homes are spread evenly, and
the per-object and per-batch forms agree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blobdata._peers import Homes
from blobdata._peers.homes import NUMPY_FROM, _mix, key_hash

URLS = [f"s3://bucket/train/n{i % 1000:08d}/img_{i}.JPEG" for i in range(20000)]


def _names(n: int) -> list[str]:
    return [f"10.0.{k // 250}.{k % 250 + 1}" for k in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_homes_are_spread_evenly(n: int) -> None:
    counts = np.bincount(Homes(_names(n)).homes_of(URLS), minlength=n)
    expected = len(URLS) / n
    # A multinomial's spread: within 5 standard deviations of its mean, for every node.
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_a_node_leaving_moves_only_its_own_homes(n: int) -> None:
    names = _names(n)
    before = Homes(names)
    for gone in (0, n - 1, n // 2):  # any node may leave, not only the last
        after = Homes([x for k, x in enumerate(names) if k != gone])
        moved = 0
        for url in URLS[:5000]:
            old, new = names[before.home_of(url)], after.nodes[after.home_of(url)]
            if old != new:
                assert old == names[gone]
                moved += 1
        assert moved == sum(names[before.home_of(u)] == names[gone] for u in URLS[:5000])
        assert abs(moved / 5000 - 1 / n) < 5 * np.sqrt((1 / n) / 5000)


def test_a_node_joining_takes_about_one_share_from_every_node() -> None:
    names = _names(4)
    before, after = Homes(names), Homes([*names, "10.0.9.9"])
    moved = [u for u in URLS if before.nodes[before.home_of(u)] != after.nodes[after.home_of(u)]]
    assert all(after.nodes[after.home_of(u)] == "10.0.9.9" for u in moved)
    assert abs(len(moved) / len(URLS) - 1 / 5) < 0.02


def test_the_order_of_the_names_and_their_ranks_do_not_matter() -> None:
    names = _names(6)
    a, b = Homes(names), Homes(list(reversed(names)))
    assert all(a.nodes[a.home_of(u)] == b.nodes[b.home_of(u)] for u in URLS[:3000])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=30), st.integers(1, 12))
def test_the_batch_form_agrees_with_the_one_object_form(urls: list[str], n: int) -> None:
    homes = Homes(_names(n))
    assert homes.homes_of(urls).tolist() == [homes.home_of(u) for u in urls]


@pytest.mark.parametrize("n", [2, NUMPY_FROM - 1, NUMPY_FROM, 64, 200])
def test_every_form_gives_the_highest_score_whatever_the_number_of_nodes(n: int) -> None:
    """One object's home is scored in Python for few nodes and in numpy for many, a batch in numpy (or
    in Python for a few objects): each gives the node of the highest score, the first of equal ones."""
    homes = Homes(_names(n))
    salts = [key_hash("node\0" + name) for name in homes.nodes]
    urls = URLS[:1500]
    reference = [max(range(n), key=lambda k: (_mix(key_hash(u) ^ salts[k]), -k)) for u in urls]
    assert [homes.home_of(u) for u in urls] == reference
    assert homes.homes_of(urls).tolist() == reference
    assert [homes.homes_of(urls[k : k + 3]).tolist() for k in range(0, 30, 3)] == [
        reference[k : k + 3] for k in range(0, 30, 3)
    ]


def _calls_per_object(n: int) -> tuple[float, float]:
    """Python calls, and calls of the per-node mix, per object scored alone among ``n`` nodes."""
    import cProfile
    import pstats

    homes = Homes(_names(n))
    prof = cProfile.Profile()
    prof.enable()
    for url in URLS[:100]:
        homes.home_of(url)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    calls = sum(s[1] for s in stats.values()) / 100
    mixes = sum(s[1] for (_, _, name), s in stats.items() if name == "_mix") / 100
    return calls, mixes


def test_scoring_one_object_among_many_nodes_costs_the_same_python_calls_whatever_their_number() -> None:
    """The Python loop makes a call per node; from NUMPY_FROM nodes on, the Python calls per object do
    not grow with the nodes (what a job of 128 nodes pays on each side of a peer read)."""
    assert _calls_per_object(4)[1] == 4 and _calls_per_object(NUMPY_FROM - 1)[1] == NUMPY_FROM - 1
    few, many = _calls_per_object(NUMPY_FROM), _calls_per_object(128)
    assert few[1] == many[1] == 0 and few[0] == many[0]


def test_names_must_be_distinct_and_there_must_be_one() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Homes(["a", "b", "a"])
    with pytest.raises(ValueError, match="at least one"):
        Homes([])
    assert Homes(["only"]).home_of("s3://b/k") == 0

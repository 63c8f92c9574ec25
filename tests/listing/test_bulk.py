"""ImageFolder's rules in bulk (blobdata._listing.bulk) against the rules one object at a time that listings
used before issue 42 (and torchvision uses): which keys are kept, and in which order."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobdata._listing import IMG_EXTENSIONS
from blobdata._listing.bulk import key_sorted, starting_with, walk_sorted, with_extensions
from blobdata._stores import Columns
from blobdata._stores.s3.listing import _Order

# Characters around '/' and '.' in byte order, upper case and non-ASCII letters whose lower case is ASCII
# (the Kelvin sign) or longer (dotted capital I), NUL and \x01 (the grids' padding and marker).
CHARS = st.sampled_from([*list("ab/.-_ +~JPGjpgk0éÉ\u212a\u0130\x00\x01\t"), "𝄞"])
NAMES = st.text(CHARS, min_size=0, max_size=10)


def _columns(keys: list[str]) -> Columns:
    return Columns.from_entries((k, i, f"id{i}") for i, k in enumerate(keys))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(NAMES, max_size=40),
    st.sampled_from([IMG_EXTENSIONS, (".JPG",), ("",), (".g", "pg"), (".ÉÉ", ".k")]),
)
def test_extensions_keep_what_imagefolder_keeps(keys: list[str], extensions: tuple[str, ...]) -> None:
    got = with_extensions(_columns(keys), extensions).tolist()
    assert got == [not k.endswith("/") and k.lower().endswith(extensions) for k in keys]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(NAMES, max_size=40, unique=True), st.sampled_from(["", "a/", "ab/"]))
def test_walk_order_is_sorted_directory_then_name(keys: list[str], common: str) -> None:
    keys = [common + k for k in keys]
    ordered = walk_sorted(_columns(sorted(keys)), common)
    listed = sorted(keys)  # as a store lists them; the sort keeps ties ("" and "/") in that order
    assert ordered.key_list() == sorted(listed, key=lambda k: (k.rpartition("/")[0], k.rpartition("/")[2]))
    assert ordered.sizes.tolist() == [sorted(keys).index(k) for k in ordered.key_list()]  # rows move whole


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(NAMES, max_size=40, unique=True))
def test_key_order_and_a_folders_keys(keys: list[str]) -> None:
    shuffled = list(keys)
    random.Random(len(keys)).shuffle(shuffled)
    assert key_sorted(_columns(shuffled)).key_list() == sorted(keys)
    kept = starting_with(_columns(shuffled), b"a/").tolist()
    assert kept == [k.startswith("a/") and len(k) > 2 and not k.endswith("/") for k in shuffled]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(NAMES, max_size=12), min_size=1, max_size=4), st.sampled_from(["", "a", "a/b"]))
def test_the_columnar_order_check_is_the_page_by_page_one(pages: list[list[str]], prefix: str) -> None:
    """_Order.follow_keys (a grid of bytes) against _Order.follow (the str comparisons it replaced), page
    after page: the same verdict, at the same key, and the same keys inside the prefix."""
    grid, ref = _Order(), _Order()
    for page in pages:
        bad, inside = grid.follow_keys(_columns(page), prefix.encode())
        assert bad == ref.follow(page)
        assert inside.tolist() == [k.startswith(prefix) for k in page]
        if bad is not None:
            return
        assert (grid.by_text, grid.by_path, grid.last) == (ref.by_text, ref.by_path, ref.last)


def test_a_local_tree_lists_in_os_walk_order(tmp_path: Path) -> None:
    """The order torchvision's ImageFolder gets from sorted(os.walk()) with sorted(fnames), on a real tree."""
    rng = random.Random(7)
    names = ["a.jpg", "a-b.jpg", "a b.jpg", "a/x.jpg", "a.b/y.jpg", "a/b/c.jpg", "z.jpg", "a0/q.jpg", "é.jpg"]
    for name in names + [f"d{rng.randrange(10)}/{rng.randrange(100)}.jpg" for _ in range(30)]:
        path = tmp_path / "cls" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    expect = []
    for root, _dirs, files in sorted(os.walk(tmp_path / "cls")):
        expect += [os.path.relpath(os.path.join(root, f), tmp_path) for f in sorted(files)]
    keys = sorted(expect)  # as a store lists them: by key
    assert walk_sorted(_columns(keys), "cls/").key_list() == expect
    assert np.array_equal(with_extensions(_columns(keys), IMG_EXTENSIONS), np.ones(len(keys), dtype=bool))

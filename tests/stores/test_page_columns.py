"""Columns (blobdata._stores.base): a listing as buffers and offsets. Every operation against the same
done on the list of (key, size, identity) tuples, for keys of one length (the fast paths: a reshape, a
strided view) and of many; and Growing, whose arrays grow in place, against a plain concatenation."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobdata._stores import Columns, Growing, gather

KEYS = st.text(st.sampled_from(list("ab/.é𝄞\x00")), min_size=0, max_size=8)
ENTRIES = st.lists(st.tuples(KEYS, st.integers(0, 2**50), KEYS), max_size=30)


def _same_length(entries: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    return [(f"k{i:04d}/{k.encode().hex()[:4]:0<4}", s, e) for i, (k, s, e) in enumerate(entries)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ENTRIES, st.booleans(), st.integers(0, 3), st.data())
def test_columns_do_what_the_tuples_do(
    entries: list[tuple[str, int, str]], one_length: bool, cut: int, data: st.DataObject
) -> None:
    if one_length:
        entries = _same_length(entries)
    cols = Columns.from_entries(entries)
    assert cols.entries() == entries and len(cols) == len(entries)
    under = Columns.from_entries([("pre" * cut + k, s, e) for k, s, e in entries])  # a common prefix, cut
    assert under.cut(3 * cut).entries() == entries
    rows = data.draw(st.lists(st.integers(0, max(len(entries) - 1, 0)), max_size=10)) if entries else []
    assert cols.take(np.array(rows, dtype=np.int64)).entries() == [entries[i] for i in rows]
    mask = np.array(
        data.draw(st.lists(st.booleans(), min_size=len(entries), max_size=len(entries))), dtype=bool
    )
    assert cols.take(mask).entries() == [e for e, keep in zip(entries, mask, strict=True) if keep]
    lo = data.draw(st.integers(0, len(entries)))
    hi = data.draw(st.integers(lo, len(entries)))
    assert cols.rows(lo, hi).entries() == entries[lo:hi] and cols.head(hi).entries() == entries[:hi]
    grow = Growing()
    for a, b in ((0, lo), (lo, hi), (hi, len(entries))):
        grow.add(cols.rows(a, b))
    assert grow.done() == cols


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.integers(1, 9), st.integers(1, 12), st.integers(0, 20))
def test_gather_of_ranges_at_one_stride_is_the_slices(buf: bytes, width: int, step: int, first: int) -> None:
    n = max(0, (len(buf) - first - width) // step + 1) if len(buf) >= first + width else 0
    starts = first + step * np.arange(n, dtype=np.int64)
    a = np.frombuffer(buf, np.uint8)
    got, offsets = gather(a, starts, starts + width)
    assert got.tobytes() == b"".join(buf[s : s + width] for s in starts.tolist())
    assert offsets.tolist() == [width * i for i in range(n + 1)]
    got.fill(0) if len(got) else None  # a copy: the page's bytes are not written
    assert bytes(a) == buf

"""Table columns typed as their owners type them, with the owners' code as the oracle on the same bytes:
a CSV column as pandas' read_csv types it (then pyarrow's from_pandas, Hugging Face's own path), a JSON
Lines column as pyarrow's read_json does; and what neither reads gets an error naming file and line."""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobdata import ConfigError
from blobdata._listing import Member, SampleTable
from blobdata._tables import rows

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
paj = pytest.importorskip("pyarrow.json")


def typed(value: Any) -> Any:
    """A value with its type spelled out at every level, so 1 and 1.0 (or True and 1) differ."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def _csv_text(columns: dict[str, list[str]]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(list(columns))
    w.writerows(zip(*columns.values(), strict=True))
    return out.getvalue()


def _hugging_face_csv(text: str) -> list[dict[str, Any]]:
    """What Hugging Face's folder loader makes of a metadata.csv: pandas, then pyarrow."""
    out: list[dict[str, Any]] = pa.Table.from_pandas(pd.read_csv(io.StringIO(text))).to_pylist()
    return out


def _ours(text: str, fmt: str) -> list[dict[str, Any]]:
    return [r for _, r in rows(f"metadata.{fmt}", text.encode(), fmt, what="metadata")]


def test_a_column_is_typed_as_a_whole_as_pandas_types_it() -> None:
    text = _csv_text(
        {
            "speaker": ["007", "x12", "9"],  # a column of names: "007" stays "007"
            "caption": ["1984", "a cat", "1e3"],
            "label": ["7", "3", "12"],
            "score": ["1", "0.5", "2"],  # whole and fractional numbers: float
            "flag": ["True", "FALSE", "true"],
            "maybe": ["3", "", "NA"],  # a missing value makes an int column float
            "extreme": ["nan", "inf", "-Infinity"],
            "note": ["None", "n/a", "kept"],
        }
    )
    got, want = _ours(text, "csv"), _hugging_face_csv(text)
    assert typed(got) == typed(want)
    assert got[0]["speaker"] == "007" and got[2]["caption"] == "1e3" and got[1]["flag"] is False
    assert got[1]["extreme"] == math.inf and got[0]["extreme"] is None  # pandas' NaN, Hugging Face's None


_CELLS = ["1", "007", "-3", "+5", " 7", "8 ", "1.5", ".5", "5.", "1e3", "1E-2", "inf", "-inf", "Infinity",
          "INF", " inf", "nan", "NaN", "NA", "", "None", "null", "n/a", "#N/A", "<NA>", "True", "False",
          "TRUE", "true", "false", "True ", "yes", "x", "a b", "1_000", "0x10", "1e400", "00", "1 000",
          "1.5.", "e3", "+-5", "9223372036854775807", "-9223372036854775808"]  # fmt: skip
# (Whole numbers beyond 64 signed bits are left out: pandas makes such a column text, uint64 or float
# depending on the order of its cells, a difference docs/layouts.md states.)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_CELLS), min_size=1, max_size=5))
def test_any_column_is_typed_as_pandas_types_it(cells: list[str]) -> None:
    text = _csv_text({"a": cells, "b": ["z"] * len(cells)})
    want = [r["a"] for r in _hugging_face_csv(text)]
    got = [r["a"] for r in _ours(text, "csv")]
    assert typed(got) == typed(want), (cells, got, want)


def test_header_names_made_unique_and_short_rows_padded_as_pandas_does() -> None:
    text = "a,a,a.1,\n1,2,3,4\n5\n"
    assert typed(_ours(text, "csv")) == typed(_hugging_face_csv(text))


_NUMBER = st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False, allow_infinity=False)
_TEXT = st.sampled_from(["a", "b c", "007"])
# Each column holds one shape (as metadata does), its numbers whole or not, its values null or absent.
_SHAPES = [
    _NUMBER,
    _TEXT,
    st.booleans(),
    st.lists(_NUMBER, max_size=3),
    st.dictionaries(st.sampled_from(["p", "q"]), st.none() | _NUMBER, max_size=2),
    st.lists(st.fixed_dictionaries({}, optional={"p": _NUMBER, "q": _TEXT}), max_size=2),
    st.one_of(_NUMBER, _TEXT),  # a column pyarrow refuses
]


@st.composite
def _records(draw: Any) -> list[dict[str, Any]]:
    shapes = {c: draw(st.sampled_from(_SHAPES)) for c in ("x", "y", "z")}
    n = draw(st.integers(min_value=1, max_value=5))
    out = []
    for _ in range(n):
        row = {}
        for c, shape in shapes.items():
            if draw(st.booleans()):  # else absent from this row
                row[c] = draw(st.none() | shape)
        out.append(row)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_records())
def test_json_lines_typed_as_pyarrow_types_them(records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    got = _ours(text, "jsonl")
    for column in {k for r in records for k in r}:  # column by column: pyarrow refuses a file for one
        lines = "".join(json.dumps({column: r[column]} if column in r else {}) + "\n" for r in records)
        try:
            want = [r[column] for r in paj.read_json(io.BytesIO(lines.encode())).to_pylist()]
        except pa.ArrowInvalid:  # numbers next to text: the values stay as JSON gives them
            want = [r.get(column) for r in records]
        assert typed([r[column] for r in got]) == typed(want), (records, column)


def test_jsonl_absent_keys_mixed_numbers_and_nested_objects() -> None:
    text = '{"x": 1, "s": {"a": 1}}\n{"x": 0.5, "y": [1, 2], "s": {"b": true}}\n{"y": [2.5]}\n'
    got = _ours(text, "jsonl")
    assert typed(got) == typed(paj.read_json(io.BytesIO(text.encode())).to_pylist())
    assert got[2] == {"y": [2.5], "x": None, "s": None} and got[0]["x"] == 1.0 and got[0]["s"]["b"] is None


def test_a_long_csv_value_is_an_error_naming_file_and_line() -> None:
    text = 'file_name,caption\nx.jpg,short\ny.jpg,"' + "word " * 30_000 + '"\n'
    assert len(pd.read_csv(io.StringIO(text))) == 2  # pandas reads it; Python's csv stops at 128 KiB
    said = r"metadata m\.csv line 3 cannot be read as CSV \(a value longer than 128 KiB\): keep long text"
    with pytest.raises(ConfigError, match=said):
        list(rows("m.csv", text.encode(), "csv", what="metadata"))


@pytest.mark.parametrize("levels", [70, 100_000])
def test_deep_json_is_an_error_naming_file_and_line(levels: int) -> None:
    text = '{"ok": 1}\n{"v": ' + "[" * levels + "]" * levels + "}\n"
    with pytest.raises(
        ConfigError, match=r"metadata m\.jsonl line 2 nests lists or objects more than 64 levels"
    ):
        list(rows("m.jsonl", text.encode(), "jsonl", what="metadata"))
    ok = '{"v": ' + "[" * 60 + "]" * 60 + "}\n"
    assert len(list(rows("m.jsonl", ok.encode(), "jsonl", what="metadata"))) == 1


def test_fields_json_has_no_type_for_come_back_as_they_were() -> None:
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    fields = {
        "when": when, "day": datetime.date(2024, 2, 3), "at": datetime.time(1, 2), "raw": b"\x00\xff",
        "took": datetime.timedelta(days=-1, seconds=5), "price": decimal.Decimal("-2.50"),
        "nested": {"times": [when, None], "n": 1.5},
        # objects of the data shaped as blobdata's own tags: never read as one
        "odd": {"\x00blobdata": "dict", "v": [["a", 1]]}, "odder": {"\x00blobdata": "bytes", "v": "AA=="},
    }  # fmt: skip
    table = SampleTable("s3://b/d", [("x", [Member("x.jpg", 1, "e", "jpg")], fields), ("y", [], {"n": 1})])
    assert typed(table.fields(0)) == typed(fields) and table.fields(1) == {"n": 1}
    with pytest.raises(ConfigError, match=r"index i\.csv line 7: a field of sample 'z' cannot be kept"):
        SampleTable("s3://b/d", [("z", [Member("z.jpg", 1, "e", "jpg", 7)], {"f": object()})],
                    where="index i.csv line {}")  # fmt: skip


def test_an_index_keeps_its_own_columns_as_written(tmp_path: Any) -> None:
    """key, size, etag and version_id are blobdata's columns, not typed: a bad size is named at its line."""
    from blobdata._listing.index import read_index

    index = tmp_path / "i.jsonl"
    index.write_text('{"key": "a.txt", "size": 3}\n{"key": "b.txt", "size": 2.5}\n')
    with pytest.raises(ConfigError, match=r"i\.jsonl line 2: size 2\.5 of file:///d/b\.txt is not a whole"):
        read_index("file:///d", str(index), storage_options={})
    index = tmp_path / "i.csv"
    index.write_text("key,size,etag\na.txt,3,007\nb.txt,,1e3\n")
    samples, _ = read_index("file:///d", str(index), storage_options={})
    assert [(m.size, m.identity) for _, ms, _ in samples for m in ms] == [(3, "007"), (-1, "1e3")]

"""Columns of a table file typed as a whole, as the conventions' owners type them.

* **CSV**, as pandas' ``read_csv`` does with its defaults (Hugging Face reads a ``metadata.csv`` with it):
  a column whose every cell is a whole number is ``int``; else one whose every cell is a number (``1.5``,
  ``1e3``, ``inf``) is ``float``; else one of ``True``/``False`` (also ``TRUE``, ``true``, ...) is
  ``bool``; else every cell stays text (``"007"`` stays ``"007"`` in a column of names). pandas' missing
  values (an empty cell, ``NA``, ``nan``, ``null``, ``None``, ...) are ``None``, as Hugging Face gives
  them (pandas' NaN): so an int column with a missing cell is a float column, as in pandas.
* **JSON Lines**, as pyarrow's ``read_json`` does (Hugging Face's reader of ``metadata.jsonl``): a key
  absent from a row is ``None``; a column mixing whole and fractional numbers is ``float`` throughout
  (inside lists and objects too), and so is one holding a whole number beyond 64 bits; objects of one
  column have every key any of them has (``None`` where absent). Where pyarrow refuses a column
  (numbers mixed with text), the values stay as JSON gives them.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Container, Sequence
from typing import Any

__all__ = ["MAX_DEPTH", "NA_VALUES", "depth", "type_csv", "type_jsonl"]

#: pandas' default missing values (``pandas._libs.parsers.STR_NA_VALUES``), matched as whole cells.
NA_VALUES = frozenset(
    {"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>",
     "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"}
)  # fmt: skip
_TRUE, _FALSE = frozenset({"True", "TRUE", "true"}), frozenset({"False", "FALSE", "false"})
# What pandas' C parser reads as a number: ASCII digits, an optional sign, blanks around (no '_', no
# other digits than 0-9, no hexadecimal); infinities in any case.
_INT = re.compile(r"[ \t]*[+-]?[0-9]+[ \t]*")
_FLOAT = re.compile(
    r"[ \t]*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[ \t]*|[+-]?inf(?:inity)?", re.IGNORECASE
)
_I64 = 1 << 63

#: Nesting deeper than this in a JSON value is refused (an error naming the file and line), so that no
#: later step (typing, saving the table, reading a sample) meets Python's recursion limit.
MAX_DEPTH = 64


def type_csv(
    header: Sequence[str], rows: Sequence[Sequence[str]], keep: Container[str] = ()
) -> list[list[Any]]:
    """The columns of ``rows`` (cells as read), each typed as a whole (the module docstring); a column
    named in ``keep`` stays text as read (its missing values ``None``)."""
    na = NA_VALUES
    out = []
    for j, name in enumerate(header):
        cells = [r[j] for r in rows]  # (zip(*rows) is far slower for many rows)
        out.append([None if c in na else c for c in cells] if name in keep else _column(cells))
    return out


def _column(cells: Sequence[str]) -> list[Any]:
    na = NA_VALUES
    present = [c for c in cells if c not in na]
    if not present:
        return [None] * len(cells)
    if len(present) == len(cells) and all(map(_INT.fullmatch, present)):
        ints = list(map(int, present))
        if not (min(ints) < 0 and max(ints) >= _I64):  # int64, uint64, or (object) Python ints beyond
            return ints
        return list(cells)  # pandas keeps a column of both as text
    if all(map(_FLOAT.fullmatch, present)):  # a missing value makes an int column float, as in pandas
        return [None if c in na else float(c) for c in cells]
    if all(c in _TRUE or c in _FALSE for c in present):
        return [None if c in na else c in _TRUE for c in cells]
    return [None if c in na else c for c in cells]


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """How deeply ``value`` nests lists and objects (a scalar: 0), counted up to ``limit + 1``."""
    level, items = 0, [value]
    while items and level <= limit:
        nested: list[Any] = []
        for v in items:
            if isinstance(v, dict):
                nested.extend(v.values())
            elif isinstance(v, list):
                nested.extend(v)
        if not nested and not any(isinstance(v, (dict, list)) for v in items):
            break
        level += 1
        items = nested
    return level


# -- JSON Lines: pyarrow's read_json -------------------------------------------------------------
# A column's kind: None (only nulls so far), "bool", "int", "bigint" (beyond int64: pyarrow makes the
# column double), "float", "str", ("list", kind), ("struct", {key: kind}), or "mixed" (pyarrow would
# refuse it: values are left as they are).
_SCALAR = {bool: "bool", int: "int", float: "float", str: "str"}


def _kind_of(value: Any) -> Any:
    t = type(value)
    if value is None:
        return None
    kind = _SCALAR.get(t)
    if kind == "int" and not -_I64 <= value < _I64:
        return "bigint"
    if kind is not None:
        return kind
    if t is list:
        elem: Any = None
        for v in value:
            elem = _merge(elem, _kind_of(v))
        return ("list", elem)
    if t is dict:
        return ("struct", {k: _kind_of(v) for k, v in value.items()})
    return "mixed"


def _merge(a: Any, b: Any) -> Any:
    if a is None or a == b:
        return b
    if b is None:
        return a
    if a in ("int", "bigint", "float") and b in ("int", "bigint", "float"):
        return "float"
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0]:
        if a[0] == "list":
            return ("list", _merge(a[1], b[1]))
        fields = dict(a[1])
        for k, v in b[1].items():
            fields[k] = _merge(fields.get(k), v)
        return ("struct", fields)
    return "mixed"


def _needs(kind: Any) -> bool:
    """Whether values of ``kind`` change when made that kind (ints to float, absent keys filled)."""
    if kind == "float" or kind == "bigint":
        return True
    if isinstance(kind, tuple):
        return kind[0] == "struct" or _needs(kind[1])
    return False


def _convert(value: Any, kind: Any) -> Any:
    if value is None or kind == "mixed" or kind is None:
        return value
    if kind == "float" or kind == "bigint":
        return float(value) if type(value) is int else value
    if isinstance(kind, tuple) and kind[0] == "list" and type(value) is list:
        return [_convert(v, kind[1]) for v in value] if _needs(kind[1]) else value
    if isinstance(kind, tuple) and kind[0] == "struct" and type(value) is dict:
        return {k: _convert(value.get(k), sub) for k, sub in kind[1].items()}
    return value


def type_jsonl(rows: list[dict[str, Any]], keep: Container[str] = ()) -> None:
    """Type the rows of a JSON Lines file in place, column by column (the module docstring); a column
    named in ``keep`` keeps its values as JSON gives them (``None`` where a row lacks it)."""
    if not rows:
        return
    columns = dict.fromkeys(rows[0])
    first = columns.keys()
    uniform = True
    for row in rows:
        if row.keys() != first:
            columns.update(dict.fromkeys(row))
            uniform = False
    for name in columns:
        if name in keep:
            continue
        values = list(map(operator.itemgetter(name), rows)) if uniform else [row.get(name) for row in rows]
        types = set(map(type, values))
        if types <= _NUMBERS and int in types:  # whole numbers, maybe next to fractions and nulls
            ints = [v for v in values if type(v) is int]
            if float in types or min(ints) < -_I64 or max(ints) >= _I64:  # the column is float
                for row, v in zip(rows, values, strict=True):
                    if type(v) is int:
                        row[name] = float(v)
            continue
        if not types & {list, dict}:  # other scalars stay as they are
            continue
        kind: Any = None
        for v in values:
            kind = _merge(kind, _kind_of(v))
            if kind == "mixed":
                break
        if _needs(kind):
            for row in rows:
                if name in row:
                    row[name] = _convert(row[name], kind)
    if not uniform:
        for row in rows:
            if len(row) != len(columns):
                for name in columns:
                    row.setdefault(name, None)


_NUMBERS = frozenset({int, float, type(None)})

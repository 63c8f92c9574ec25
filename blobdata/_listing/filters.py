"""What identifies an ``is_valid_file`` filter, so that a remembered listing is reused only for the
same filter.

Two closures of the same code (``only(".png")`` and ``only(".jpeg")``) are different filters, and so is
one function whose module-level constant changed between runs. A filter's identity is therefore a
hash of everything its result can depend on that Python lets us see: its code (nested code objects
included), its defaults, the values in its closure, the values of the globals its code names, and
for a ``functools.partial`` or a bound method the bound arguments too. A value is identified by its
``repr`` only for plain data (numbers, strings, bytes, None, and tuples, lists, sets and dicts of
them), by pattern and flags for compiled regular expressions, by name for modules, classes and
builtins, and recursively for functions. Anything else (an object with state) makes the filter
unidentifiable: its listing is then never remembered, and the caller lists afresh.
"""

from __future__ import annotations

import functools
import hashlib
import re
import types
from collections.abc import Callable
from typing import Any

__all__ = ["UNIDENTIFIED", "filter_identity"]

#: Stored in a manifest's parameters for a filter that could not be identified.
UNIDENTIFIED = "<unidentified>"

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_MAX_DEPTH = 8


class _Unknown(Exception):
    pass


def filter_identity(fn: Callable[..., Any]) -> str | None:
    """A short hash identifying ``fn``'s behaviour as far as it can be seen, or None if it cannot."""
    try:
        parts: list[str] = []
        _describe(fn, parts, 0, set())
    except (_Unknown, RecursionError):
        return None
    return hashlib.sha256("\x00".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _describe(value: Any, out: list[str], depth: int, seen: set[int]) -> None:
    if depth > _MAX_DEPTH:
        raise _Unknown
    if isinstance(value, _PLAIN):
        out.append(f"{type(value).__name__}:{value!r}")
        return
    if id(value) in seen:  # a recursive function names itself through its globals
        out.append("<seen>")
        return
    if isinstance(value, (tuple, list, frozenset, set)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        out.append(f"{type(value).__name__}[{len(items)}")
        for item in items:
            _describe(item, out, depth + 1, seen)
        out.append("]")
        return
    if isinstance(value, dict):
        out.append(f"dict[{len(value)}")
        for k in sorted(value, key=repr):
            _describe(k, out, depth + 1, seen)
            _describe(value[k], out, depth + 1, seen)
        out.append("]")
        return
    if isinstance(value, re.Pattern):
        out.append(f"re:{value.pattern!r}:{value.flags}")
        return
    if isinstance(value, types.ModuleType):
        out.append(f"module:{value.__name__}")
        return
    if isinstance(value, (type, types.BuiltinFunctionType, types.MethodDescriptorType,
                          types.WrapperDescriptorType)):  # fmt: skip
        owner = getattr(value, "__self__", None)
        bound = not isinstance(owner, (types.ModuleType, type(None)))
        if isinstance(value, types.BuiltinFunctionType) and bound:
            raise _Unknown  # a builtin bound to an object ([].append): its state is unseen
        out.append(f"named:{getattr(value, '__module__', '?')}.{value.__qualname__}")
        return
    if isinstance(value, functools.partial):
        out.append("partial")
        for part in (value.func, value.args, value.keywords):
            _describe(part, out, depth + 1, seen)
        return
    if isinstance(value, types.MethodType):
        out.append("method")
        _describe(value.__func__, out, depth + 1, seen)
        _describe(value.__self__, out, depth + 1, seen)
        return
    if isinstance(value, types.FunctionType):
        seen.add(id(value))
        out.append(f"function:{value.__module__}.{value.__qualname__}")
        _code(value.__code__, out)
        _describe(value.__defaults__, out, depth + 1, seen)
        _describe(value.__kwdefaults__, out, depth + 1, seen)
        cells = value.__closure__ or ()
        try:
            _describe([c.cell_contents for c in cells], out, depth + 1, seen)
        except ValueError:  # an empty cell: a closure variable not yet assigned
            raise _Unknown from None
        names = _global_names(value.__code__)
        _describe({n: value.__globals__[n] for n in names if n in value.__globals__}, out, depth + 1, seen)
        return
    raise _Unknown


def _code(code: types.CodeType, out: list[str]) -> None:
    out.append(f"code:{code.co_code.hex()}:{code.co_names!r}:{code.co_varnames!r}:{code.co_freevars!r}")
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code(const, out)
        else:
            out.append(f"{type(const).__name__}:{const!r}")


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names

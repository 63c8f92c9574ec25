"""The one place that knows whether this is a new process.

DataLoader workers are forked, spawned or forkserved; every per-process object (a socket pool, an SQLite
connection, a staging area, the background loop) must be made anew in the child and the parent's copy
must never be used or closed there. Modules do not call ``os.getpid()`` or ``os.register_at_fork``
themselves: they ask :func:`pid` (a cached value renewed in a forked child, so the hot path makes no
system call), register hooks with :func:`at_fork`, or hold their object in a :class:`PerProcess`.

Hooks run in registration order, ``before`` in the forking thread just before ``os.fork()`` and
``after_in_child`` first thing in the child; ``pid()`` is renewed before any child hook runs.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PerProcess", "at_fork", "orphan", "pid"]

T = TypeVar("T")

_pid = os.getpid()
_before: list[Callable[[], None]] = []
_child: list[Callable[[], None]] = []
#: Objects inherited from a parent process: kept referenced, never used, so that no destructor
#: (closing a socket, an SQLite handle) runs against the parent's resources.
_orphans: list[Any] = []


def pid() -> int:
    """This process's id (cached; renewed in a forked child before any child hook runs)."""
    return _pid


def at_fork(
    *, before: Callable[[], None] | None = None, after_in_child: Callable[[], None] | None = None
) -> None:
    """Register fork hooks (run in registration order). Exceptions in a hook are not propagated."""
    if before is not None:
        _before.append(before)
    if after_in_child is not None:
        _child.append(after_in_child)


def orphan(obj: Any) -> None:
    """Keep ``obj`` alive for the life of this process without ever using it (an inherited client)."""
    _orphans.append(obj)


def _run(hooks: list[Callable[[], None]]) -> None:
    for hook in list(hooks):
        with contextlib.suppress(Exception):  # a failing hook must not break fork
            hook()


def _before_fork() -> None:
    _run(_before)


def _after_in_child() -> None:
    global _pid
    _pid = os.getpid()
    _run(_child)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_in_child)


class PerProcess(Generic[T]):
    """A value made lazily by ``factory`` once per process; an inherited one is orphaned, not reused.

    Pickles as its factory alone, so a spawned child makes its own value too. Thread-safe creation.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._value: T | None = None
        self._owner = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_factory": self._factory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_factory"])  # type: ignore[misc]

    def get(self) -> T:
        """This process's value, made on first use."""
        value = self._value
        if value is not None and self._owner == _pid:
            return value
        if self._owner != _pid and self._value is not None:
            self._lock = threading.Lock()  # the inherited one may be held by a thread that is not here
        with self._lock:
            if self._value is not None and self._owner == _pid:
                return self._value
            if self._value is not None:
                orphan(self._value)
            self._value = self._factory()
            self._owner = _pid
            return self._value

    def peek(self) -> T | None:
        """This process's value if it was made here, else None (nothing is made)."""
        return self._value if self._owner == _pid else None

    def reset(self) -> T | None:
        """Forget this process's value and return it (the caller closes it); None if there is none."""
        value = self.peek()
        self._value = None
        return value

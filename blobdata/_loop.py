"""The one async-to-sync bridge: one event loop on one daemon thread per process.

Every coroutine blobdata runs (listing, fetching, look-ahead) goes through :func:`run` or
:func:`submit`. The loop is created lazily and recreated in each new process (:mod:`blobdata._process`), so a
DataLoader worker started by fork never touches the parent's loop (which has no thread there),
and spawn/forkserver workers simply start their own.

At interpreter exit the objects registered with :func:`close_at_exit` are closed on the loop. The
loop itself is left running (its thread is a daemon): fsspec's filesystems close their sessions in
``weakref.finalize`` callbacks that run later in the exit sequence and need a running loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from . import _process

__all__ = ["close_at_exit", "get_loop", "run", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "loop": None, "thread": None}
_closables: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(obj: Any) -> None:
    """Await ``obj.aclose()`` on the loop at interpreter exit, if ``obj`` is still alive then."""
    _closables.add(obj)


def get_loop() -> asyncio.AbstractEventLoop:
    """The running background loop of this process, started on first use."""
    pid = _process.pid()
    loop = _state["loop"]
    if loop is not None and _state["pid"] == pid:
        return loop  # type: ignore[no-any-return]
    with _lock:
        if _state["loop"] is not None and _state["pid"] == pid:
            return _state["loop"]  # type: ignore[no-any-return]
        # After fork the inherited loop object belongs to a thread that does not exist here:
        # drop it without closing (closing would touch the parent's selector fds).
        new_loop = asyncio.new_event_loop()
        ready = threading.Event()

        def _serve() -> None:
            asyncio.set_event_loop(new_loop)
            new_loop.call_soon(ready.set)
            new_loop.run_forever()

        thread = threading.Thread(target=_serve, name="blobdata-io", daemon=True)
        thread.start()
        ready.wait()
        _state.update(pid=pid, loop=new_loop, thread=thread)
        return new_loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the background loop and return a thread-safe future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


def run(coro: Awaitable[T], timeout: float | None = None) -> T:
    """Run ``coro`` on the background loop and wait for its result from synchronous code.

    Must not be called from the loop's own thread (that would deadlock).
    """
    loop = get_loop()
    if threading.current_thread() is _state["thread"]:
        raise RuntimeError("blobdata._loop.run() called from the blobdata event loop thread")

    abandoned = False

    async def _wrap() -> T | None:
        try:
            return await coro
        except BaseException:
            if abandoned:
                # The caller left (Ctrl-C, a timeout) and cancelled us: nobody reads this error, and
                # asyncio would print it as "Task exception was never retrieved" (a raw traceback,
                # such as "cannot schedule new futures after interpreter shutdown" at exit).
                return None
            raise

    future = asyncio.run_coroutine_threadsafe(_wrap(), loop)
    try:
        return future.result(timeout)  # type: ignore[return-value]  # None only once abandoned
    except BaseException:
        abandoned = True
        future.cancel()
        raise


def _shutdown() -> None:
    loop = _state["loop"]
    if loop is None or _state["pid"] != _process.pid():
        return

    async def _close_all() -> None:
        closers = [obj.aclose() for obj in list(_closables)]
        await asyncio.gather(*closers, return_exceptions=True)

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(_close_all(), loop).result(2.0)


atexit.register(_shutdown)

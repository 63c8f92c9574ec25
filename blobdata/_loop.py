"""The one async-to-sync bridge: one event loop on one daemon thread per process.

Every coroutine blobdata runs (listing, fetching, look-ahead) goes through :func:`run` or
:func:`submit`. The loop is created lazily and recreated when ``os.getpid()`` changes, so a
DataLoader worker started by fork never touches the parent's loop (which has no thread there),
and spawn/forkserver workers simply start their own. The loop is stopped at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from typing import Any, Awaitable, Coroutine, TypeVar

__all__ = ["get_loop", "run", "submit"]

T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "loop": None, "thread": None}


def get_loop() -> asyncio.AbstractEventLoop:
    """The running background loop of this process, started on first use."""
    pid = os.getpid()
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

    async def _wrap() -> T:
        return await coro

    future = asyncio.run_coroutine_threadsafe(_wrap(), loop)
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise


def _shutdown() -> None:
    loop = _state["loop"]
    if loop is None or _state["pid"] != os.getpid():
        return
    thread = _state["thread"]

    async def _cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(2.0)
    except Exception:
        pass
    loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join(2.0)
    _state.update(loop=None, thread=None, pid=None)


atexit.register(_shutdown)

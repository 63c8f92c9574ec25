"""How a batch waits for its reads on the loop (``_await_all``): as ``asyncio.gather(...,
return_exceptions=True)`` gives them, the oracle here, without a callback and a turn of the loop for
each read done already (the look-ahead's, mostly); cancelled with the batch, its reads are too."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from blobdata._dataset.base import BlobDatasetBase
from blobdata._errors import BlobdataError
from blobdata._loop import run

pytestmark = pytest.mark.timeout(30)


def _futures(loop: asyncio.AbstractEventLoop, error: BlobdataError) -> list[asyncio.Future[Any]]:
    """Done, failed, cancelled, one done a little later, one failing later, and the first again."""
    done, failed, cancelled = loop.create_future(), loop.create_future(), loop.create_future()
    done.set_result(b"a")
    failed.set_exception(error)
    cancelled.cancel()
    later, fails_later = loop.create_future(), loop.create_future()
    loop.call_later(0.05, later.set_result, b"b")
    loop.call_later(0.08, fails_later.set_exception, error)
    return [done, failed, cancelled, later, fails_later, done]


def test_a_batchs_reads_are_given_as_gather_gives_them() -> None:
    error = BlobdataError("s3://b/k.jpg: gone")

    async def both() -> tuple[list[Any], list[Any]]:
        loop = asyncio.get_running_loop()
        mine = await BlobDatasetBase._await_all(None, list(range(6)), _futures(loop, error))  # type: ignore[arg-type]
        theirs = await asyncio.gather(*_futures(loop, error), return_exceptions=True)
        return mine, list(theirs)

    mine, theirs = run(both())
    assert len(mine) == len(theirs) == 6
    for m, t in zip(mine, theirs, strict=True):
        assert type(m) is type(t)
        assert m == t if isinstance(t, bytes) else m is t or isinstance(m, asyncio.CancelledError)
    assert mine[1] is error and mine[4] is error and mine[0] == mine[5] == b"a" and mine[3] == b"b"


def test_a_batch_given_up_gives_up_its_reads() -> None:
    """The batch built ahead that will not be used is cancelled (``_build_ahead``): its reads still in
    flight are cancelled with it, as gather's were; those done are left as they are."""

    async def go() -> tuple[bool, bool, bool]:
        loop = asyncio.get_running_loop()
        done, pending = loop.create_future(), loop.create_future()
        done.set_result(b"a")
        waiting = asyncio.ensure_future(BlobDatasetBase._await_all(None, [0, 1], [done, pending]))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return pending.cancelled(), done.cancelled(), done.result() == b"a"

    assert run(go()) == (True, False, True)


def test_reads_done_already_are_taken_without_a_turn_of_the_loop() -> None:
    """A batch whose reads the look-ahead has all done: its results are there at once, the coroutine
    never suspends (gather would schedule a callback for each read and wait a turn of the loop)."""

    async def go() -> list[Any]:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in range(32)]
        for k, f in enumerate(futs):
            f.set_result(bytes([k]))
        coro = BlobDatasetBase._await_all(None, list(range(32)), futs)  # type: ignore[arg-type]
        try:
            coro.send(None)
        except StopIteration as stop:
            return list(stop.value)
        coro.close()
        raise AssertionError("the batch waited on the loop for reads that were done")

    assert run(go()) == [bytes([k]) for k in range(32)]

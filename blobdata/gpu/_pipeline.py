"""The loader's device path: workers fetch bytes, the training process decodes whole batches on the device.

``ds.dataloader(..., device="cuda", gpu_transform=gpu.TrainTransform(224))`` makes the DataLoader
workers return each batch as a :class:`RawBatch` (every sample's bytes end to end in one uint8
tensor, which crosses to the training process through shared memory, plus offsets, URLs and
targets). A :class:`DevicePipeline` in the training process turns raw batches into training batches:
:func:`~blobdata.gpu.decode_each` (the GPU's JPEG decoder, Pillow for what it refuses), then the
``gpu_transform`` on the decoded images, in a background thread on a side CUDA stream, at most
``depth`` batches ahead. So batch k+1 is decoded while the model trains on batch k.

Stream hand-off: the side stream records an event after a batch's last kernel; the consumer's current
stream waits for that event (a device-side wait, no host sync) and the batch's tensors are marked as
used on it (``record_stream``), so the caching allocator never reuses their memory early. On
``device="cpu"`` the same thread runs without streams, which is how CI tests the whole path.

A sample no one can decode raises its :class:`~blobdata.DecodeError` (naming the URL) in the training
loop, or, under ``on_error="skip"``, is dropped from its batch and reported like any skipped sample.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from .. import _stats
from .._errors import BlobdataError
from . import _decode_checked, check_device

__all__ = ["RawBatch", "DevicePipeline", "collate_raw"]

_END = object()


class RawBatch(NamedTuple):
    """A batch as fetched: ``data[offsets[k]:offsets[k + 1]]`` is sample k's bytes."""

    data: torch.Tensor
    offsets: torch.Tensor
    urls: list[str]
    targets: list[Any]

    def samples(self) -> list[bytes]:
        buf = self.data.numpy()
        return [buf[a:b].tobytes() for a, b in itertools.pairwise(self.offsets.tolist())]


def collate_raw(samples: Sequence[tuple[bytes, str, Any]]) -> RawBatch:
    """The workers' collate function on the device path: bytes joined into one tensor."""
    bounds = [0, *itertools.accumulate(len(data) for data, _, _ in samples)]
    data = torch.empty(bounds[-1], dtype=torch.uint8)
    buf = data.numpy()
    for (sample, _, _), a, b in zip(samples, bounds, bounds[1:], strict=False):  # one copy per sample
        buf[a:b] = np.frombuffer(sample, dtype=np.uint8)
    offsets = torch.tensor(bounds, dtype=torch.int64)
    # Targets stay per sample: the training process collates them after dropping undecodable samples.
    return RawBatch(data, offsets, [url for _, url, _ in samples], [t for _, _, t in samples])


class DevicePipeline:
    """Decodes and transforms raw batches on ``device`` in a background thread, ``depth`` batches ahead.

    ``report(url, exc)`` is called for a sample dropped under ``on_error="skip"``; with
    ``on_error="raise"`` the error reaches the loop. A batch whose every sample was dropped yields
    None (the loader leaves it out, but counts it, so that resuming stays exact).
    """

    def __init__(
        self,
        transform: Callable[[list[torch.Tensor]], torch.Tensor],
        device: str | torch.device,
        *,
        on_error: Any = "raise",
        report: Callable[[str, BlobdataError], None] | None = None,
        depth: int = 2,
    ) -> None:
        self.device = check_device(device)  # a clear error now, not in the first batch
        self.transform = transform
        self.on_error = on_error
        self.report = report
        self.depth = max(1, int(depth))
        self._running: tuple[threading.Event, threading.Thread] | None = None
        self._lock = threading.Lock()

    def stop_previous(self, timeout: float = 60.0) -> None:
        """Stop the last epoch's decode thread before a new epoch resets the DataLoader's iterator.

        With ``persistent_workers`` every epoch shares one iterator of the workers' batches, and a
        new ``iter(loader)`` resets it: a thread of an unfinished epoch still pulling from it would
        race the reset. The thread stops after the batch it is waiting for; the old epoch's
        iterator then ends. Raises :class:`BlobdataError` if it has not stopped within ``timeout``.
        """
        with self._lock:
            running, self._running = self._running, None
        if running is None:
            return
        stop, thread = running
        stop.set()
        thread.join(timeout)
        if thread.is_alive():
            raise BlobdataError(
                f"the previous epoch's decode thread did not stop within {timeout:.0f} s (a worker is "
                "stuck); finish or delete the old iterator before starting a new epoch"
            )

    def __call__(self, batches: Iterator[RawBatch]) -> Iterator[tuple[torch.Tensor, Any] | None]:
        out: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        device = self.device
        if device.type == "cuda" and device.index is None:
            # The training thread's current GPU (DDP's set_device(rank)); the decode thread has its own.
            device = torch.device("cuda", torch.cuda.current_device())
        args = (batches, out, stop, device)
        thread = threading.Thread(target=self._produce, args=args, name="blobdata-device-decode", daemon=True)
        with self._lock:  # stop_previous() sees no thread or a started one
            thread.start()
            self._running = (stop, thread)
        cuda = device.type == "cuda"
        try:
            while True:
                try:
                    item = out.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set() and not thread.is_alive():  # stopped by a newer epoch
                        return
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    yield None
                    continue
                images, targets, event = item
                if cuda:
                    current = torch.cuda.current_stream(device)
                    current.wait_event(event)  # on the device: the host does not wait
                    _apply(functools.partial(_used_on, current), (images, targets))
                yield images, targets
        finally:
            with self._lock:
                if self._running is not None and self._running[1] is thread:
                    self._running = None
            stop.set()
            with contextlib.suppress(queue.Empty):  # unblock a producer waiting to put
                while True:
                    out.get_nowait()
            thread.join(timeout=2.0)  # it ends after the batch it is waiting for (a daemon thread)

    def _produce(
        self, batches: Iterator[RawBatch], out: queue.Queue[Any], stop: threading.Event, device: torch.device
    ) -> None:
        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        # The decoded images of each batch still in flight on the device, with the batch's event. A
        # decoder's own buffers (nvImageCodec's are not torch's) may be freed outside the side
        # stream's order once unreferenced: they are kept until the kernels reading them are done.
        held: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        try:
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
            for raw in batches:
                if stop.is_set():
                    return
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    made, decoded = self._make(raw, device)
                    event = None
                    if stream is not None and made is not None:
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(stream)
                        held.append((event, decoded))
                while held and held[0][0].query():  # done on the device: release (never waits)
                    held.popleft()
                if not put(None if made is None else (*made, event)):
                    return
            put(_END)
        except BaseException as exc:  # reaches the training loop through the queue
            put(exc)
        finally:
            for event, _ in held:  # this thread may wait; the training loop does not
                event.synchronize()

    def _make(self, raw: RawBatch, device: torch.device) -> tuple[tuple[torch.Tensor, Any] | None, list[Any]]:
        """(the batch and its targets, or None if every sample was skipped; the decoded images)."""
        t = time.perf_counter()
        decoded = _decode_checked(raw.samples(), raw.urls, device)  # the device was checked at start
        keep = []
        for k, item in enumerate(decoded):
            if isinstance(item, BlobdataError):
                if self.on_error == "raise" or self.report is None:
                    raise item
                self.report(raw.urls[k], item)
            else:
                keep.append(k)
        rec = _stats.rec()
        rec[_stats.DECODE_S] += time.perf_counter() - t
        if not keep:
            return None, decoded
        images = [decoded[k] for k in keep]
        targets = torch.utils.data.default_collate([raw.targets[k] for k in keep])
        t = time.perf_counter()
        batch = self.transform(images)  # type: ignore[arg-type]
        targets = _apply(lambda x: x.to(device, non_blocking=True), targets)
        rec[_stats.TRANSFORM_S] += time.perf_counter() - t
        return (batch, targets), decoded


def _used_on(stream: Any, tensor: torch.Tensor) -> None:
    tensor.record_stream(stream)  # the caching allocator keeps its memory until ``stream`` is done


def _apply(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` on every tensor in ``value`` (nested lists, tuples and dicts), keeping the structure."""
    if isinstance(value, torch.Tensor):
        out = fn(value)
        return value if out is None else out
    if isinstance(value, dict):
        return {k: _apply(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_apply(fn, v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    return value

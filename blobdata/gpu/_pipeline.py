"""The loader's device path: workers fetch bytes, the training process decodes whole batches on the device.

``ds.dataloader(..., device="cuda", gpu_transform=gpu.TrainTransform(224))``: each DataLoader worker
reads every sample's JPEG header (:func:`~blobdata.gpu._jpeg.prepare`), keeps the bytes of the JPEGs
the GPU takes and decodes the rest itself (PNG, CMYK...: it has the bytes and a core), and returns the
batch as a :class:`RawBatch`: everything end to end in one uint8 tensor allocated in shared memory
(so it crosses to the training process as a handle, not a copy), with per-sample offsets, kinds,
sizes, URL keys and targets. In the training process a :class:`DevicePipeline` runs two stages,
each a thread on its own side CUDA stream, ``depth`` batches ahead of the loop:

1. decode: the batch's JPEGs in one call of the device's decoder (made lazily in this thread, after
   ``set_device``: :mod:`._decoders`), worker-decoded pixels copied over, Pillow for what the GPU
   refused (counted; a warning past :data:`REFUSED_WARN_SHARE`);
2. transform: the ``gpu_transform`` on the decoded images (for :class:`~blobdata.gpu.TrainTransform`
   with boxes and flips drawn from the loader's seed, the epoch and each sample's URL), targets moved.

So batch k+2 is decoded while batch k+1 is transformed and the model trains on batch k.

Stream hand-off: stage 1 records an event after a batch's decode, stage 2's stream waits for it
(on the device); stage 2 records an event after the batch's last kernel, the consumer's current
stream waits for that (no host sync) and the batch's tensors are marked as used on it
(``record_stream``). Decoded images stay referenced until stage 2's event has passed, so neither
torch's caching allocator nor nvImageCodec's reuses their memory early. On ``device="cpu"`` the same
threads run without streams, which is how CI tests the whole path.

A sample no one can decode raises its :class:`~blobdata.DecodeError` (naming the URL) in the training
loop, or, under ``on_error="skip"``, is dropped from its batch and reported like any skipped sample.
An epoch that ends with an error shuts its workers down at once (its threads keep no reference to
the DataLoader's iterator that an exception's traceback could hold).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils.data

from .._errors import BlobdataError
from .._metrics import stats as _stats
from . import _decoders, check_device
from ._batch import CPU, GPU, PIXELS, decode_views
from ._jpeg import read_header
from ._transform import epoch_seed

__all__ = ["REFUSED_WARN_SHARE", "DevicePipeline", "RawBatch", "collate_raw"]

_log = logging.getLogger("blobdata")
_END = object()
#: Warn (once per loader) when the GPU decoder has refused this share of the JPEGs sent to it, and at
#: least :data:`REFUSED_WARN_MIN` of them: each refused JPEG is decoded with Pillow in the training process.
REFUSED_WARN_SHARE = 0.01
REFUSED_WARN_MIN = 8


class RawBatch(NamedTuple):
    """A batch as fetched: ``data[offsets[k]:offsets[k + 1]]`` is sample k's bytes (``kinds[k]`` GPU or
    CPU) or its RGB pixels (PIXELS, ``shapes[k]`` = (height, width)); ``keys[k]`` hashes its URL."""

    data: torch.Tensor
    offsets: np.ndarray
    kinds: np.ndarray
    shapes: np.ndarray
    keys: np.ndarray
    urls: list[str]
    targets: list[Any]

    def samples(self) -> list[np.ndarray]:
        """Each sample's uint8 view of :attr:`data` (no copy)."""
        buf = self.data.numpy()
        off = self.offsets.tolist()
        return [buf[a:b] for a, b in itertools.pairwise(off)]

    def pin_memory(self, device: Any = None) -> RawBatch:
        """As is: the bytes go to a decoder, not to the GPU as they are (``pin_memory=True`` is moot)."""
        return self


def _shared_bytes(n: int) -> torch.Tensor:
    """``n`` uninitialised bytes; in a DataLoader worker, in shared memory, so that sending the batch to
    the training process passes a handle instead of copying every byte once more."""
    empty = torch.empty(0, dtype=torch.uint8)
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(n, dtype=torch.uint8)
    return empty.new(empty._typed_storage()._new_shared(n))  # type: ignore[no-untyped-call]


def collate_raw(samples: Sequence[tuple[bytes | np.ndarray, str, Any]]) -> RawBatch:
    """The workers' collate function on the device path: every sample's bytes or pixels in one tensor."""
    n = len(samples)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([s.nbytes if isinstance(s, np.ndarray) else len(s) for s, _, _ in samples], out=offsets[1:])
    data = _shared_bytes(int(offsets[-1]))
    buf = data.numpy()
    kinds = np.empty(n, dtype=np.int8)
    shapes = np.zeros((n, 2), dtype=np.int64)
    keys = np.empty(n, dtype=np.int64)
    for k, (sample, url, _) in enumerate(samples):
        a, b = offsets[k], offsets[k + 1]
        if isinstance(sample, np.ndarray):  # decoded by the worker (blobdata.gpu._jpeg.prepare)
            buf[a:b] = sample.reshape(-1)
            kinds[k] = PIXELS
            shapes[k] = sample.shape[:2]
        else:
            buf[a:b] = np.frombuffer(sample, dtype=np.uint8)
            header = read_header(sample, whole=False)  # prepare() walked it in full and checked it
            kinds[k] = GPU if header is not None and header.gpu else CPU
            if header is not None:
                shapes[k] = (header.height, header.width)
        keys[k] = zlib.crc32(url.encode())
    # Targets stay per sample: the training process collates them after dropping undecodable samples.
    urls, targets = [u for _, u, _ in samples], [t for _, _, t in samples]
    return RawBatch(data, offsets, kinds, shapes, keys, urls, targets)


class _Feed:
    """The epoch's DataLoader iterator, held in one place the pipeline clears when the epoch ends: no
    thread's frame refers to it, so a traceback kept by the training loop does not keep workers alive."""

    def __init__(self, it: Iterator[RawBatch]) -> None:
        self.it: Iterator[RawBatch] | None = it


class _Decoded(NamedTuple):
    images: list[torch.Tensor]
    sizes: np.ndarray
    keys: np.ndarray
    targets: list[Any]
    seed: int


class DevicePipeline:
    """Decodes and transforms raw batches on ``device`` in two background stages, ``depth`` batches ahead.

    ``report(url, exc)`` is called for a sample dropped under ``on_error="skip"``; with
    ``on_error="raise"`` the error reaches the loop. A batch whose every sample was dropped yields
    None (the loader leaves it out, but counts it, so that resuming stays exact). The augmentation's
    seed is ``generator.initial_seed()`` (the loader's ``generator=``), else drawn once from torch's
    global generator when the pipeline is made; a :class:`~blobdata.BlobLoader` sets it to its own
    (:func:`blobdata._sampling.loader_seed`, recorded in its state), which the CPU path's transforms share.
    """

    def __init__(
        self,
        transform: Callable[[list[torch.Tensor]], torch.Tensor],
        device: str | torch.device,
        *,
        on_error: Any = "raise",
        report: Callable[[str, BlobdataError], None] | None = None,
        depth: int = 2,
        generator: torch.Generator | None = None,
    ) -> None:
        self.device = check_device(device)  # a clear error now, not in the first batch; nothing started
        self.transform = transform
        self.on_error = on_error
        self.report = report
        self.depth = max(1, int(depth))
        self.seed = (
            generator.initial_seed()
            if generator is not None
            else int(torch.empty((), dtype=torch.int64).random_().item())
        )
        self._calls = 0
        self._sent = self._refused = 0
        self._warned = False
        self._running: tuple[threading.Event, list[threading.Thread]] | None = None
        self._lock = threading.Lock()

    def stop_previous(self, timeout: float = 60.0) -> None:
        """Stop the last epoch's threads before a new epoch resets the DataLoader's iterator.

        With ``persistent_workers`` every epoch shares one iterator of the workers' batches, and a
        new ``iter(loader)`` resets it: a thread of an unfinished epoch still pulling from it would
        race the reset. The threads stop after the batch they are waiting for; the old epoch's
        iterator then ends. Raises :class:`BlobdataError` if they have not stopped within ``timeout``.
        """
        with self._lock:
            running, self._running = self._running, None
        if running is None:
            return
        stop, threads = running
        stop.set()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise BlobdataError(
                f"the previous epoch's decode thread did not stop within {timeout:.0f} s (a worker is "
                "stuck); finish or delete the old iterator before starting a new epoch"
            )

    def __call__(
        self, batches: Iterator[RawBatch], progress: Any = None
    ) -> Iterator[tuple[torch.Tensor, Any] | None]:
        """The epoch's training batches from ``batches``; ``progress.epoch`` (read when the first batch
        arrives) numbers the epoch for the augmentation's draws (else this pipeline counts its calls)."""
        self._calls += 1
        calls = self._calls
        epoch: Callable[[], int] = (lambda: int(progress.epoch)) if progress is not None else (lambda: calls)
        feed = _Feed(batches)
        del batches  # only the feed refers to the DataLoader's iterator from here on
        mid: queue.Queue[Any] = queue.Queue(maxsize=1)
        out: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        device = self.device
        if device.type == "cuda" and device.index is None:
            # The training thread's current GPU (DDP's set_device(rank)); the stages set it for themselves.
            device = torch.device("cuda", torch.cuda.current_device())
        threads = [
            threading.Thread(
                target=self._decode_stage, args=(feed, mid, stop, device, epoch),
                name="blobdata-device-decode", daemon=True,
            ),
            threading.Thread(
                target=self._transform_stage, args=(mid, out, stop, device),
                name="blobdata-device-transform", daemon=True,
            ),
        ]  # fmt: skip
        with self._lock:  # stop_previous() sees no threads or started ones
            for thread in threads:
                thread.start()
            self._running = (stop, threads)
        cuda = device.type == "cuda"
        failed = True
        try:
            while True:
                try:
                    item = out.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set() and not any(t.is_alive() for t in threads):  # stopped by a newer epoch
                        failed = False
                        return
                    continue
                if item is _END:
                    failed = False
                    return
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    yield None
                    continue
                images, targets, event = item
                del item
                if cuda:
                    current = torch.cuda.current_stream(device)
                    current.wait_event(event)  # on the device: the host does not wait
                    _apply(functools.partial(_used_on, current), (images, targets))
                yield images, targets
                del images, targets
        except GeneratorExit:  # the loop stopped early (break, a new epoch): not an error
            failed = False
            raise
        finally:
            with self._lock:
                if self._running is not None and self._running[1] is threads:
                    self._running = None
            stop.set()
            for q in (out, mid):  # unblock a stage waiting to put
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
            for thread in threads:
                thread.join(timeout=2.0)  # each ends after the batch it is waiting for (daemon threads)
            it, feed.it = feed.it, None
            if failed and not any(t.is_alive() for t in threads):
                _shut_down(it)
            del it  # this frame may outlive the epoch in a traceback: it must not hold the workers

    # -- stage 1 ---------------------------------------------------------------------------------------
    def _decode_stage(
        self,
        feed: _Feed,
        mid: queue.Queue[Any],
        stop: threading.Event,
        device: torch.device,
        epoch: Callable[[], int],
    ) -> None:
        try:
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
            decoder = _decoders.for_device(device)  # made here, after set_device, on first use
            seed: int | None = None
            while not stop.is_set():
                it = feed.it
                raw = next(it, _END) if it is not None else _END
                del it
                if raw is _END or stop.is_set():
                    break
                if seed is None:  # the sampler has begun the epoch by now
                    seed = epoch_seed(self.seed, epoch())
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    decoded = self._decode(raw, decoder, device, seed)  # type: ignore[arg-type]
                    event = None
                    if stream is not None and decoded is not None:
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(stream)
                del raw
                if not _put(mid, None if decoded is None else (decoded, event), stop):
                    return
            _put(mid, _END, stop)
        except BaseException as exc:  # reaches the training loop through stage 2
            _put(mid, exc, stop)

    def _decode(
        self, raw: RawBatch, decoder: _decoders.DeviceDecoder, device: torch.device, seed: int
    ) -> _Decoded | None:
        t = time.perf_counter()
        shapes = [(int(h), int(w)) for h, w in raw.shapes.tolist()]
        decoded, refused = decode_views(decoder, raw.samples(), raw.kinds.tolist(), shapes, raw.urls, device)
        keep = []
        for k, item in enumerate(decoded):
            if isinstance(item, BlobdataError):
                if self.on_error == "raise" or self.report is None:
                    raise item
                self.report(raw.urls[k], item)
            else:
                keep.append(k)
        self._note_refusals(int((raw.kinds == GPU).sum()), refused, decoder.name)
        _stats.rec()[_stats.DECODE_S] += time.perf_counter() - t
        if not keep:
            return None
        images = [d for d in decoded if isinstance(d, torch.Tensor)]
        return _Decoded(images, raw.shapes[keep], raw.keys[keep], [raw.targets[k] for k in keep], seed)

    def _note_refusals(self, sent: int, refused: int, name: str) -> None:
        self._sent += sent
        self._refused += refused
        few = self._refused < REFUSED_WARN_MIN or self._refused < REFUSED_WARN_SHARE * self._sent
        if self._warned or few:
            return
        self._warned = True
        _log.warning(
            "blobdata.gpu: the GPU decoder (%s) refused %d of the %d JPEGs sent to it so far; they were "
            "decoded with Pillow in the training process, which slows it down (nvImageCodec refuses when "
            "its allocations fail while torch's caching allocator holds the GPU's memory, or when its "
            "nvJPEG library does not load); loader.stats().device_refused counts them",
            name, self._refused, self._sent,
        )  # fmt: skip

    # -- stage 2 ---------------------------------------------------------------------------------------
    def _transform_stage(
        self, mid: queue.Queue[Any], out: queue.Queue[Any], stop: threading.Event, device: torch.device
    ) -> None:
        # The decoded images of each batch still in use on the device, with the event that marks the end
        # of its transform: released once the event has passed (never waited for here).
        held: collections.deque[tuple[Any, list[torch.Tensor]]] = collections.deque()
        try:
            cuda = device.type == "cuda"
            if cuda:
                torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
            while True:
                item = _get(mid, stop)
                if item is _END or item is stop:
                    _put(out, _END, stop)
                    return
                if isinstance(item, BaseException):
                    _put(out, item, stop)
                    return
                made = None
                if item is not None:
                    decoded, ready = item
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        if stream is not None and ready is not None:
                            stream.wait_event(ready)
                        made = self._transform_one(decoded, device)
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                            event.record(stream)
                            held.append((event, decoded.images))
                    del decoded, item
                while held and held[0][0].query():  # done on the device: release
                    held.popleft()
                if not _put(out, None if made is None else (*made, event), stop):
                    return
        except BaseException as exc:  # reaches the training loop through the queue
            _put(out, exc, stop)
        finally:
            for event, _ in held:  # this thread may wait; the training loop does not
                event.synchronize()

    def _transform_one(self, decoded: _Decoded, device: torch.device) -> tuple[torch.Tensor, Any]:
        t = time.perf_counter()
        targets = torch.utils.data.default_collate(decoded.targets)
        transform: Any = self.transform
        if hasattr(transform, "draw_keyed") and hasattr(transform, "apply"):
            boxes, flips = transform.draw_keyed(decoded.sizes, decoded.keys, decoded.seed)
            batch = transform.apply(decoded.images, boxes, flips)
        else:
            batch = transform(decoded.images)
        targets = _apply(lambda x: x.to(device, non_blocking=True), targets)
        _stats.rec()[_stats.TRANSFORM_S] += time.perf_counter() - t
        return batch, targets


def _put(q: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue[Any], stop: threading.Event) -> Any:
    """The next item, or ``stop`` itself once it is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue
    return stop


def _shut_down(it: Any) -> None:
    """End a failed epoch's non-persistent DataLoader workers now, not at the next garbage collection."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None and not getattr(it, "_persistent_workers", False):
        shutdown()


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

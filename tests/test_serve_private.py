"""``blobdata serve`` is its user's alone and leaves nothing behind (issue 39, rows 10 and 11): keys made
for each run, SeaweedFS's filer, master and gRPC ports closed to another user of the machine (one reached
by fork + setuid, who reads the ports from the server's command line as ``ps`` shows it to everyone),
and its temporary directory, logs and gRPC sockets gone after Ctrl-C, SIGTERM, SIGHUP, or, after SIGKILL,
at the next start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobdata.testing import LocalS3Server, S3Endpoint, s3_client
from tests.support.other_user import as_other_user
from tests.test_serve import _env, _read_until

pytestmark = [pytest.mark.network, pytest.mark.timeout(180)]
PUBLISHED = ("blobdata-test", "blobdata-test-secret")  # the key pair the docs used to print
_REFUSED = r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied"
#: An HTTP/2 client's first bytes: the preface and an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


class Served:
    """A ``blobdata serve`` process, its exports, and its SeaweedFS server's pid and ports."""

    def __init__(self, proc: subprocess.Popen[str], printed: str, tmpdir: Path) -> None:
        import psutil

        self.proc, self.tmpdir = proc, tmpdir
        lines = [line.removeprefix("export ") for line in printed.splitlines() if line.startswith("export ")]
        self.exports = dict(line.split("=", 1) for line in lines)
        [weed] = psutil.Process(proc.pid).children()
        self.weed = weed.pid
        args = Path(f"/proc/{weed.pid}/cmdline").read_bytes().decode().split("\0")  # what ps shows everyone
        flags = [a.lstrip("-").split("=", 1) for a in args if ".port" in a and "=" in a]
        self.ports = {name: int(value) for name, value in flags if int(value)}

    def endpoint(self, key: str, secret: str) -> S3Endpoint:
        return S3Endpoint(self.exports["AWS_ENDPOINT_URL_S3"], key, secret)

    def sockets(self) -> list[Path]:
        return [Path(f"/tmp/seaweedfs-{part}-grpc-{self.ports[part + '.port.grpc']}.sock")
                for part in ("master", "volume", "filer", "s3")]  # fmt: skip


def _serve(tmp_path: Path, *args: str) -> Served:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    env = {**_env(tmp_path), "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobdata", "serve", *args], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        return Served(proc, _read_until(proc, "Serving until Ctrl-C", timeout_s=120), tmpdir)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = _serve(tmp_path, "--backend", "seaweedfs")
    try:
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGINT)
            s.proc.communicate(timeout=60)


def _http(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""  # refused


def _answers_grpc_in_clear(port: int) -> bool:
    """Whether a gRPC server answers a client without credentials on ``port``: an HTTP/2 preface in the
    clear gets a SETTINGS frame back from a server that speaks HTTP/2 without TLS."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(_H2_PREFACE)
        try:
            head = conn.recv(9)
        except OSError:
            return False
    return len(head) == 9 and head[3] == 0x04  # a SETTINGS frame


def test_serve_is_private_to_its_user(served: Served) -> None:
    key, secret = served.exports["AWS_ACCESS_KEY_ID"], served.exports["AWS_SECRET_ACCESS_KEY"]
    assert (key, secret) != PUBLISHED and key not in PUBLISHED and secret not in PUBLISHED
    owner = s3_client(served.endpoint(key, secret))
    owner.create_bucket(Bucket="mine")
    owner.put_object(Bucket="mine", Key="secret.txt", Body=b"the owner's data")
    ports = served.ports

    def attack() -> None:
        stranger = s3_client(served.endpoint(*PUBLISHED))
        with pytest.raises(Exception, match=_REFUSED):
            stranger.get_object(Bucket="mine", Key="secret.txt")
        status, body = _http(ports["filer.port"], "/buckets/mine/secret.txt")
        assert b"the owner's data" not in body and status not in range(200, 300), status
        status, _ = _http(ports["master.port"], "/col/delete?collection=mine")
        assert status not in range(200, 300), status
        status, _ = _http(ports["volume.port"], "/")
        assert status not in range(200, 300), status
        for part in ("master", "volume", "filer", "s3"):
            assert not _answers_grpc_in_clear(ports[f"{part}.port.grpc"]), part

    as_other_user(attack)
    assert owner.get_object(Bucket="mine", Key="secret.txt")["Body"].read() == b"the owner's data"


def test_each_run_has_its_own_keys(tmp_path: Path) -> None:
    with LocalS3Server() as a, LocalS3Server() as b:
        assert {a.access_key, b.access_key}.isdisjoint(PUBLISHED) and a.access_key != b.access_key
        assert a.secret_key != b.secret_key and len(a.secret_key) >= 32
        with pytest.raises(Exception, match=_REFUSED):
            s3_client(S3Endpoint(a.endpoint_url, b.access_key, b.secret_key)).list_buckets()


def test_serve_with_moto_warns_that_anyone_can_use_it(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    s = _serve(tmp_path, "--backend", "moto")
    s.proc.send_signal(signal.SIGINT)
    _, err = s.proc.communicate(timeout=60)
    assert "moto checks no credentials" in err and "any user of this machine" in err, err


def _left(s: Served) -> list[str]:
    return sorted(os.listdir(s.tmpdir)) + [str(p) for p in s.sockets() if os.path.lexists(p)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_serve_leaves_nothing_on_every_stop(tmp_path: Path, sig: int) -> None:
    s = _serve(tmp_path, "--backend", "seaweedfs")
    assert [n for n in os.listdir(s.tmpdir) if n.startswith("blobdata-weed-")]  # while it serves
    assert all(p.exists() for p in s.sockets())
    s.proc.send_signal(sig)
    out, err = s.proc.communicate(timeout=60)
    assert s.proc.returncode == 0, (out, err)
    assert _left(s) == []  # no data directory, no weed.* log in $TMPDIR, no gRPC socket in /tmp


def test_what_a_killed_serve_left_is_swept_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _serve(tmp_path, "--backend", "seaweedfs")
    os.kill(s.proc.pid, signal.SIGKILL)  # no handler runs; the server dies with it (PR_SET_PDEATHSIG)
    s.proc.communicate(timeout=60)
    _wait_gone(s.weed)
    left = _left(s)
    assert any(n.startswith("blobdata-weed-") for n in left), left
    monkeypatch.setattr(tempfile, "tempdir", str(s.tmpdir))  # the next server, in the same $TMPDIR
    with LocalS3Server() as server:
        assert server.tmpdir is not None and server.tmpdir.parent == s.tmpdir
        assert [n for n in os.listdir(s.tmpdir) if n.startswith("blobdata-weed-")] == [server.tmpdir.name]
        assert not any(os.path.lexists(p) for p in s.sockets())
    assert _left(s) == []


def _wait_gone(pid: int) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).wait(timeout=30)

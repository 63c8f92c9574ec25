"""``blobdata serve --demo``: the README's local quick start, run as a user runs it (issue 30).

The server runs in a subprocess as on a terminal; its printed ``export`` lines are parsed and used by
``blobdata ls`` in another process; SIGINT then stops it with one line and exit code 0.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from blobdata.testing import LocalS3Server, s3_client, synthetic_dataset, upload

ROOT = Path(__file__).resolve().parents[1]
BACKEND = os.environ.get("BLOBDATA_TEST_S3_SERVER", "seaweedfs")


def _read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """stdout of ``proc`` up to the line holding ``marker``; fails with what was read by the deadline.

    Lines are read by a thread (a select() on the pipe would miss lines already in Python's buffer)."""
    assert proc.stdout is not None
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    stdout = proc.stdout

    def pump() -> None:
        for line in iter(stdout.readline, ""):
            lines.put(line)
            if marker in line:
                return

    threading.Thread(target=pump, daemon=True).start()
    text, deadline = "", time.monotonic() + timeout_s
    while marker not in text:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {marker!r} within {timeout_s}s (exit {proc.poll()}):\n{text}")
        try:
            text += lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if proc.poll() is not None:
                raise AssertionError(f"exited {proc.returncode} before {marker!r}:\n{text}") from None
    return text


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BLOBDATA_TEST_"))}
    env.update(PYTHONPATH=str(ROOT), BLOBDATA_CACHE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    return env


@pytest.mark.network
@pytest.mark.timeout(180)
def test_serve_demo_exports_work_and_ctrl_c_stops_cleanly(tmp_path: Path) -> None:
    env = _env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobdata", "serve", "--demo", "--images", "24", "--classes", "3",
         "--backend", BACKEND, "--cache-dir", str(tmp_path / "cache")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        printed = _read_until(proc, "Serving until Ctrl-C", timeout_s=120)
        assert "uploaded 24 JPEGs in 3 classes" in printed, printed
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in printed.splitlines()
            if line.startswith("export ")
        )
        assert set(exports) >= {"AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}, printed
        # The next commands are printed to paste, each on its own line.
        for command in ("blobdata ls s3://demo/train", "blobdata warm s3://demo/train", "blobdata bench"):
            assert any(line.startswith(command) for line in printed.splitlines()), (command, printed)
        assert any("examples/train_resnet.py s3://demo/train" in line for line in printed.splitlines())

        ls = subprocess.run(
            [sys.executable, "-m", "blobdata", "ls", "s3://demo/train"],
            env={**env, **exports}, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert ls.returncode == 0, ls.stderr
        assert "3 classes, 24 objects" in ls.stdout, ls.stdout
        assert "n00000002" in ls.stdout

        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, (out, err)
    assert out.strip().splitlines() == ["blobdata serve: stopped; the S3 server and its data are gone"], out
    assert "Traceback" not in err, err
    # The server went with it: its endpoint refuses connections.
    port = int(exports["AWS_ENDPOINT_URL_S3"].rsplit(":", 1)[1])
    import socket

    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@pytest.mark.network
@pytest.mark.timeout(120)
def test_sigterm_stops_serve_like_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobdata.testing", "serve", "--backend", BACKEND],
        cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        printed = _read_until(proc, "Serving until Ctrl-C", timeout_s=90)
        assert "then upload a folder" in printed  # no --demo: an empty bucket, and how to fill it
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err
    assert out.strip().endswith("blobdata serve: stopped; the S3 server and its data are gone"), out


@pytest.mark.network
@pytest.mark.timeout(120)
def test_a_server_started_in_a_helper_thread_outlives_the_thread() -> None:
    """PR_SET_PDEATHSIG follows the forking thread: servers are forked by one long-lived thread, so
    a server started from a thread that then exits keeps serving (before: killed with the thread)."""
    box: list[LocalS3Server] = []
    thread = threading.Thread(target=lambda: box.append(LocalS3Server(backend=BACKEND).__enter__()))
    thread.start()
    thread.join(timeout=90)
    assert box, "the server did not start"
    server = box[0]
    try:
        assert server.wait(timeout=0.5) is None  # still serving: PDEATHSIG would have fired by now
        assert server.running
        server.create_bucket("after")
        # upload() returns how many objects it uploaded (it returned bytes before).
        assert upload(s3_client(server), "after", synthetic_dataset(3, 1, prefix="t")) == 3
    finally:
        server.stop()
    assert not server.running


def test_testing_main_without_serve_says_how_to_use_it() -> None:
    done = subprocess.run([sys.executable, "-m", "blobdata.testing"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 2
    assert "python -m blobdata.testing serve" in done.stderr


@pytest.mark.network
@pytest.mark.timeout(120)
def test_serve_says_when_its_server_dies(tmp_path: Path) -> None:
    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "blobdata", "serve", "--backend", BACKEND],
        cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _read_until(proc, "Serving until Ctrl-C", timeout_s=90)
        children = psutil.Process(proc.pid).children()
        assert len(children) == 1, children  # the S3 server, in its own process group
        os.killpg(children[0].pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 1, (out, err)
    assert "the S3 server exited on its own (code -9)" in err, err


def test_serve_data_refuses_what_it_cannot_serve_before_starting(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a" / "same").mkdir(parents=True)
    (tmp_path / "b" / "same").mkdir(parents=True)
    (tmp_path / "a" / "same" / "x.txt").write_text("x")
    (tmp_path / "b" / "same" / "y.txt").write_text("y")
    for argv, said in (
        (["--data", str(tmp_path / "nope")], "no such folder"),
        (["--data", str(tmp_path / "empty")], "the folder holds no file"),
        (["--data", str(tmp_path / "a" / "same"), "--data", str(tmp_path / "b" / "same")], "its own name"),
    ):
        done = subprocess.run([sys.executable, "-m", "blobdata", "serve", *argv], env=_env(tmp_path),
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and said in done.stderr and not done.stdout, (argv, done.stderr)


def test_folder_files_names_every_file_as_a_key(tmp_path: Path) -> None:
    from blobdata.testing import folder_files

    (tmp_path / "d" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "d" / "a b.jpg").write_bytes(b"1")
    (tmp_path / "d" / "sub" / "deeper" / "x.seg.png").write_bytes(b"2")
    (tmp_path / "d" / "link.txt").symlink_to(tmp_path / "d" / "a b.jpg")  # read through
    (tmp_path / "d" / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "d" / "to-dir").symlink_to(tmp_path / "d" / "sub", target_is_directory=True)  # not followed
    os.mkfifo(tmp_path / "d" / "fifo")
    os.mkdir(tmp_path / "d" / b"\xff-not-utf8".decode("utf-8", "surrogateescape"))
    (tmp_path / "d" / b"\xff-not-utf8".decode("utf-8", "surrogateescape") / "z.txt").write_text("z")
    files, left = folder_files(tmp_path / "d", "mine")
    assert [k for k, _ in files] == ["mine/a b.jpg", "mine/link.txt", "mine/sub/deeper/x.seg.png"]
    assert [os.path.basename(p) for p in left] == ["z.txt"]

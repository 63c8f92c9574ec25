"""What a newcomer meets in the first hour at the command line (issue 30): a listing from memory is
said to be one, refused credentials stop a warm at once with one message, Ctrl-C is one line and
counts nothing as failed, and progress bars are drawn only on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from test_cli import _default_sigint, _env, option_args, run, upload

pytestmark = [pytest.mark.network, pytest.mark.usefixtures("isolated_cache_home")]


def test_ls_and_warm_say_when_the_listing_comes_from_memory(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3_bucket, 6)
    opts = option_args(s3_bucket.storage_options)
    url = s3_bucket.url("train")
    code, out, err = run(capsys, "ls", url, *opts)
    assert code == 0, err
    assert out.splitlines()[0].startswith("layout: class folders") and out.splitlines()[1].endswith(
        "(listed now)"
    ), out
    code, out, err = run(capsys, "ls", url, *opts)
    assert code == 0, err
    first = out.splitlines()[1]
    assert "(remembered listing from " in first and " s old: --refresh lists the bucket again)" in first, (
        first
    )
    code, out, _ = run(capsys, "ls", url, "--json", *opts)
    assert json.loads(out)["remembered"] is True
    code, out, _ = run(capsys, "ls", url, "--json", "--refresh", *opts)
    assert json.loads(out)["remembered"] is False
    code, out, err = run(capsys, "warm", url, "--cache-dir", str(tmp_path / "c"), *opts)
    assert code == 0, err
    assert out.splitlines()[1].startswith(f"{url}: remembered listing from "), out


def test_warm_stops_at_the_first_access_denied_with_one_message(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3_bucket, 200, size=500)
    url = s3_bucket.url("train")
    code, _, err = run(capsys, "ls", url, *option_args(s3_proxy.storage_options))  # remembered
    assert code == 0, err
    wrong = {**s3_proxy.storage_options, "secret": "not-the-secret"}
    code, out, err = run(
        capsys, "warm", url, "--cache-dir", str(tmp_path / "c"), "--concurrency", "4", *option_args(wrong)
    )
    assert code == 1
    assert len(out.splitlines()) == 2 and "remembered listing" in out.splitlines()[1], out  # no summary
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blobdata: error: ") and "access denied" in lines[0]
    assert "warm stopped at the first refusal" in lines[0]
    assert "the listing was remembered, so these credentials were not checked before" in lines[0]
    assert "not-the-secret" not in err
    gets = [p for method, p in s3_proxy.requests if method == "GET" and "list-type" not in p]
    assert len(gets) <= 8, f"{len(gets)} GETs after the first refusal"  # before: 64 refused at least


def test_ctrl_c_during_the_listing_is_one_line(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    s3_bucket.put_many({f"train/c{c:02d}/{i}.jpg": b"x" * 100 for c in range(40) for i in range(2)})
    s3_proxy.delay = 0.15  # one way: each of the 40 class listings takes 0.3 s at least
    cmd = [sys.executable, "-m", "blobdata", "warm", s3_bucket.url("train"), "--cache-dir",
           str(tmp_path / "c"), "--concurrency", "2", *option_args(s3_proxy.storage_options)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(s3_proxy.requests) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)  # listing: the first page and the first class prefixes
        assert proc.poll() is None and len(s3_proxy.requests) >= 3, "the listing ended before Ctrl-C"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip() == "blobdata: interrupted", err  # before: "Task exception was never retrieved" ...


@pytest.mark.slow
def test_ctrl_c_during_warm_is_one_line_and_nothing_failed(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path
) -> None:
    upload(s3_bucket, 200, size=20_000)
    s3_proxy.delay = 0.05
    cache = tmp_path / "c"
    cmd = [sys.executable, "-m", "blobdata", "warm", s3_bucket.url("train"), "--cache-dir", str(cache),
           "--concurrency", "16", *option_args(s3_proxy.storage_options)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if sum(1 for m, _ in s3_proxy.requests if m == "GET") >= 40:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "warm ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    layout, interrupted = out.strip().splitlines()  # the layout line, then one line
    assert layout.startswith("layout: class folders") and interrupted.startswith("interrupted "), out
    assert "fail" not in out and not err.strip(), (out, err)  # one line in all: no traceback, no failure


def _on_a_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` with stderr on a pseudo-terminal; its exit code and what it drew there."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    try:
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=120)
    finally:
        os.close(leader)
    return code, b"".join(chunks).decode("utf-8", "replace")


def test_warm_draws_bars_on_a_terminal_only(s3_bucket: Any, tmp_path: Path) -> None:
    upload(s3_bucket, 8)
    base = [
        sys.executable,
        "-m",
        "blobdata",
        "warm",
        s3_bucket.url("train"),
        *option_args(s3_bucket.storage_options),
    ]
    code, drawn = _on_a_terminal([*base, "--cache-dir", str(tmp_path / "a")])
    assert code == 0 and "warm: 100%" in drawn, drawn
    code, drawn = _on_a_terminal([*base, "--cache-dir", str(tmp_path / "b"), "--quiet"])
    assert code == 0 and "warm:" not in drawn, drawn
    done = subprocess.run([*base, "--cache-dir", str(tmp_path / "c")], env=_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "warm:" not in done.stderr and "\r" not in done.stderr, done.stderr


def test_ctrl_c_while_the_console_script_imports_is_one_line() -> None:
    """The ``blobdata`` script imports the package (numpy, ...) before any of its code runs: an
    interrupt there is said in one line too. (Simulated: the interrupt is raised right after the import.)"""
    code = "import sys; sys.argv[0] = '/venv/bin/blobdata'; import blobdata; raise KeyboardInterrupt"
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (-signal.SIGINT, 128 + signal.SIGINT), done.returncode
    assert done.stderr.strip() == "blobdata: interrupted", done.stderr
    # Any other program that imports blobdata keeps Python's own handling.
    other = subprocess.run([sys.executable, "-c", "import blobdata; raise KeyboardInterrupt"], env=_env(),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "Traceback" in other.stderr

"""Command-line behaviour a new user trips on (issue 11, items 8-9): each test failed before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blobdata import __version__
from blobdata._cli import main

ROOT = Path(__file__).resolve().parents[2]


def _tree(root: Path, n: int = 40, classes: int = 20) -> Path:
    for i in range(n):
        d = root / f"class{i % classes:04d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.png").write_bytes(b"x" * 10)
    return root


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "blobdata", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_cache_info_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["cache", "info", "--cache-dir", str(empty)]) == 1
    assert list(empty.iterdir()) == []  # before: cache.db was created
    assert "no cache" in capsys.readouterr().err


def test_warm_dry_run_writes_nothing_and_fails_when_it_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _tree(tmp_path / "data")
    cache = tmp_path / "cache"
    code = main(["warm", str(data), "--cache-dir", str(cache), "--dry-run", "-q"])
    assert code == 0 and "fits in" in capsys.readouterr().out
    assert not cache.exists()  # before: the directory was created
    (data / "class0000" / "big.png").write_bytes(b"x" * 100_000)
    code = main(["warm", str(data), "--cache-dir", str(cache), "--cache-size", "64KiB", "--dry-run", "-q"])
    assert code == 1 and "does NOT fit" in capsys.readouterr().out  # before: exit 0
    assert not cache.exists()


def test_version_and_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    assert main(["cache", "info", "--help"]) == 0
    assert "nothing is created" in capsys.readouterr().out  # --cache-dir has a help text
    done = _run("demo", "--help")
    assert done.returncode == 0 and "``" not in done.stdout  # no reStructuredText in --help


def test_allow_empty_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _tree(tmp_path / "data", 4)
    (data / "empty-class").mkdir()
    assert main(["ls", str(data), "-q"]) == 1
    err = capsys.readouterr().err
    assert "--allow-empty" in err
    assert main(["ls", str(data), "-q", "--allow-empty"]) == 0


def test_closed_pipe_is_quiet(tmp_path: Path) -> None:
    data = _tree(tmp_path / "data", 3000, classes=3000)  # a listing longer than a pipe's buffer
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = f"{sys.executable} -m blobdata ls {data} --json | head -c 10"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stdout) == 10

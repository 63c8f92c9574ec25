"""The set-up script installs once: a second run with nothing changed reinstalls nothing (issue 11)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.xdist_group("venv")  # never beside another run of scripts/setup.sh on the same .venv
@pytest.mark.timeout(600)
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv")
def test_setup_reinstalls_only_when_pyproject_changed() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    traces = []
    for _ in range(2):  # the first run may install (a stale or missing stamp); the second must not
        done = subprocess.run(["bash", "-x", "scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True,
                              env=env, timeout=580)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        traces.append(done.stderr)
    assert "pip install -e" not in traces[1], traces[1][-2000:]
    stamp = (ROOT / ".venv" / ".blobdata-installed").read_text()
    assert stamp.split()[0] in subprocess.run(["sha256sum", "pyproject.toml"], cwd=ROOT, capture_output=True,
                                              text=True, check=True).stdout  # fmt: skip


@pytest.mark.slow
@pytest.mark.xdist_group("venv")  # never beside another run of scripts/setup.sh on the same .venv
@pytest.mark.timeout(600)
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv")
def test_test_script_says_what_it_does_and_how_long_it_takes() -> None:
    """Issue 40: test.sh ran 39 minutes without a word of how long, and had no quick subset."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    usage = subprocess.run(["bash", "scripts/test.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                           env=env, timeout=60)  # fmt: skip
    assert usage.returncode == 0 and "--quick" in usage.stdout and "not network and not slow" in usage.stdout
    wrong = subprocess.run(["bash", "scripts/test.sh", "--qiuck"], cwd=ROOT, capture_output=True, text=True,
                           env=env, timeout=60)  # fmt: skip
    assert wrong.returncode == 2 and "unknown argument --qiuck" in wrong.stderr
    done = subprocess.run(["bash", "scripts/test.sh", "--quick", "--", "tests/test_url.py"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=580)  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert out.startswith("scripts/test.sh --quick: ruff, mypy and the tests that start no server; usually ")
    for step in ("== ruff check (usually ", "== mypy (usually ", "== pytest (quick) (usually "):
        assert step in out, step
    assert "== mkdocs" not in out  # not part of the quick run
    times = out[out.index("== times") :].splitlines()
    assert [line.split()[0] for line in times[1:4]] == ["ruff", "mypy", "pytest"] and "in all" in times[4]
    assert out.rstrip().endswith("all checks passed")

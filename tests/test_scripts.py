"""The set-up script installs once: a second run with nothing changed reinstalls nothing (issue 11)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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
    assert "pip install -q -e" not in traces[1], traces[1][-2000:]
    stamp = (ROOT / ".venv" / ".blobdata-installed").read_text()
    assert stamp.split()[0] in subprocess.run(["sha256sum", "pyproject.toml"], cwd=ROOT, capture_output=True,
                                              text=True, check=True).stdout  # fmt: skip

"""``-m "not network"`` starts no server: the suite is run in a subprocess with a plugin that sees
every server start (``tests/support/no_servers.py``).

``--setup-only`` sets up each selected test's fixtures without running its body, which is where a
server would start (a session or autouse fixture, a module-level start, a fixture that asks for a
server at run time); it takes seconds where running the whole local suite takes half a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("BLOBDATA_TEST_S3_ENDPOINT", None)  # an external S3 would need no server process
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.no_servers", "-p", "no:cacheprovider",
         "--setup-only", "-q", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


@pytest.mark.slow  # sets up every test of the suite in a subprocess
def test_not_network_starts_no_server() -> None:
    out = _pytest("-m", "not network", f"--ignore={Path(__file__).relative_to(ROOT)}", "tests")
    assert "servers started: none" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " deselected" in out.stdout  # the suite has network tests: they were left out


@pytest.mark.network
def test_the_plugin_sees_a_server_start() -> None:
    """The check above can fail: one test that uses ``s3_bucket`` starts the S3 server."""
    out = _pytest("tests/test_support.py::test_buckets_are_fresh_per_test")
    assert "servers started: weed" in out.stdout or "servers started: moto" in out.stdout, out.stdout
    assert out.returncode != 0

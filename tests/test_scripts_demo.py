"""``scripts/demo.sh`` sets up only what the demo uses: no Azure emulator (issue 30)."""

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
def test_demo_setup_does_not_look_for_azurite() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "BLOBDATA_AZURITE")}
    env["BLOBDATA_EXTRAS"] = "dev"  # what scripts/test.sh installed: nothing to reinstall for this check
    done = subprocess.run(["bash", "-x", "scripts/demo.sh", "--help"], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=580)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: blobdata demo" in done.stdout
    assert "azurite-blob" not in done.stderr and "npm install" not in done.stderr, done.stderr[-2000:]

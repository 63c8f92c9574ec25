"""Refreshable AWS credentials are resolved once per node: four processes that start together run the
profile's ``credential_process`` once and all sign with what it gave; static ones are never written
anywhere; the shared file is this user's only and lives in memory (/dev/shm)."""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from blobdata._stores.s3 import credentials as node_credentials

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)), reason="shares through /dev/shm"
)

_PROCESS = """
import datetime, json, sys
with open(sys.argv[1], "a") as f:
    f.write("ran\\n")
doc = {"Version": 1, "AccessKeyId": "AKIDNODE", "SecretAccessKey": "node-secret", "SessionToken": "tok"}
if sys.argv[2] == "refreshable":
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    doc["Expiration"] = later.isoformat()
print(json.dumps(doc))
"""

_CHILD = """
import json, sys
from blobdata._stores.s3.sigv4 import resolve_chain
f = resolve_chain(sys.argv[1]).get_frozen_credentials()
print(json.dumps([f.access_key, f.secret_key, f.token]))
"""


def _setup(tmp_path: Path, kind: str) -> tuple[str, dict[str, str], Path]:
    profile = f"bd-{uuid.uuid4().hex[:8]}"
    script, runs = tmp_path / "process.py", tmp_path / "runs.txt"
    script.write_text(_PROCESS)
    config = tmp_path / "config"
    config.write_text(f"[profile {profile}]\ncredential_process = {sys.executable} {script} {runs} {kind}\n")
    (tmp_path / "credentials").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(ROOT)})  # fmt: skip
    return profile, env, runs


def _run_four(profile: str, env: dict[str, str]) -> list[list[str]]:
    cmd = [sys.executable, "-c", _CHILD, profile]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(o) for o in outs]


def _shared_file(profile: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Path | None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    path = node_credentials._path(profile)
    return Path(path) if path else None


@pytest.mark.timeout(180)
def test_refreshable_credentials_are_resolved_once_per_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile, env, runs = _setup(tmp_path, "refreshable")
    shared = _shared_file(profile, env, monkeypatch)
    assert shared is not None
    try:
        got = _run_four(profile, env)
        assert got == [["AKIDNODE", "node-secret", "tok"]] * 4
        assert runs.read_text().count("ran") == 1  # one process asked; three read what it got
        st = shared.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and stat.S_IMODE(shared.parent.stat().st_mode) == 0o700
        doc = json.loads(shared.read_text())
        assert doc["expiry"] > datetime.datetime.now().timestamp() + 3000
        assert _run_four(profile, env)[0][0] == "AKIDNODE" and runs.read_text().count("ran") == 1
    finally:
        for p in (shared, Path(str(shared) + ".lock")):
            p.unlink(missing_ok=True)


@pytest.mark.timeout(180)
def test_static_credentials_are_never_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile, env, runs = _setup(tmp_path, "static")
    shared = _shared_file(profile, env, monkeypatch)
    assert shared is not None
    try:
        assert _run_four(profile, env) == [["AKIDNODE", "node-secret", "tok"]] * 4
        assert runs.read_text().count("ran") == 4  # each resolved its own: nothing shared
        assert not shared.exists()
    finally:
        Path(str(shared) + ".lock").unlink(missing_ok=True)

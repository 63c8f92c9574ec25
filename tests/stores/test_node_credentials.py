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
f = resolve_chain(sys.argv[1] or None).get_frozen_credentials()
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
    path = node_credentials._path(node_credentials.chain_key(profile))
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


# -- issue 39, rows 3 and 9: what selects the credentials, and what is never written ------------------

_NAMED = """
import datetime, json, sys
later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
name = sys.argv[1]
print(json.dumps({"Version": 1, "AccessKeyId": "AKID" + name, "SecretAccessKey": name + "-secret",
                  "SessionToken": name + "-tok", "Expiration": later.isoformat()}))
"""


def _resolve_in_child(env: dict[str, str], profile: str = "") -> list[str]:
    cmd = [sys.executable, "-c", _CHILD, profile]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    got: list[str] = json.loads(out)
    return got


def _shared_files() -> list[Path]:
    from blobdata._node import memory_dir

    top = memory_dir()
    assert top is not None
    return sorted(Path(top).glob("credentials-*.json"))


@pytest.mark.timeout(180)
def test_a_job_with_another_aws_profile_never_signs_with_the_first_jobs_credentials(tmp_path: Path) -> None:
    script = tmp_path / "named.py"
    script.write_text(_NAMED)
    config = tmp_path / "config"
    config.write_text("".join(
        f"[profile {name}-{tmp_path.name}]\ncredential_process = {sys.executable} {script} {name}\n"
        for name in ("alpha", "beta")
    ))  # fmt: skip
    (tmp_path / "credentials").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(ROOT)})  # fmt: skip
    before = set(_shared_files())
    try:
        # An earlier job of the node, AWS_PROFILE=alpha: its refreshable credentials are shared.
        assert _resolve_in_child({**env, "AWS_PROFILE": f"alpha-{tmp_path.name}"})[0] == "AKIDalpha"
        assert len(set(_shared_files()) - before) == 1
        # The next job chooses beta, by AWS_PROFILE or by AWS_DEFAULT_PROFILE: beta's, never alpha's.
        assert _resolve_in_child({**env, "AWS_PROFILE": f"beta-{tmp_path.name}"})[0] == "AKIDbeta"
        assert _resolve_in_child({**env, "AWS_DEFAULT_PROFILE": f"beta-{tmp_path.name}"})[0] == "AKIDbeta"
        # storage_options' profile (the argument) and the variable together: the argument wins, as in s3fs.
        got = _resolve_in_child({**env, "AWS_PROFILE": f"beta-{tmp_path.name}"}, f"alpha-{tmp_path.name}")
        assert got[0] == "AKIDalpha"
    finally:
        for p in set(_shared_files()) - before:
            p.unlink(missing_ok=True)
            Path(str(p) + ".lock").unlink(missing_ok=True)


def test_the_chain_key_changes_with_what_selects_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    config = tmp_path / "config"
    config.write_text("[profile a]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    keys = {node_credentials.chain_key(None), node_credentials.chain_key("a")}
    for name, value in [
        ("AWS_PROFILE", "a"), ("AWS_DEFAULT_PROFILE", "a"),
        ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "c")),
        ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"), ("AWS_WEB_IDENTITY_TOKEN_FILE", str(tmp_path / "t")),
        ("AWS_ROLE_SESSION_NAME", "s"), ("AWS_REGION", "eu-west-1"), ("AWS_DEFAULT_REGION", "eu-west-2"),
        ("AWS_ENDPOINT_URL_STS", "http://127.0.0.1:1"), ("AWS_STS_REGIONAL_ENDPOINTS", "regional"),
        ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "http://127.0.0.1:2"),
        ("AWS_CONTAINER_AUTHORIZATION_TOKEN", "x"),
    ]:  # fmt: skip
        monkeypatch.setenv(name, value)
        key = node_credentials.chain_key(None)
        assert key not in keys, name
        keys.add(key)
        monkeypatch.delenv(name)
    config.write_text("[profile a]\nrole_arn = arn:aws:iam::1:role/other\nsource_profile = b\n")
    assert node_credentials.chain_key("a") not in keys  # the same file, edited: another selection


@pytest.mark.timeout(180)
def test_environment_credentials_with_an_expiration_are_never_written(tmp_path: Path) -> None:
    later = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)).isoformat()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_SECRET_ACCESS_KEY": "env-secret-39",
                "AWS_SESSION_TOKEN": "env-token-39", "AWS_CREDENTIAL_EXPIRATION": later,
                "AWS_CONFIG_FILE": str(tmp_path / "none"),
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(ROOT)})  # fmt: skip
    before = set(_shared_files())
    try:
        assert _resolve_in_child(env) == ["AKIDENV", "env-secret-39", "env-token-39"]
        for p in _shared_files():  # none holds them: docs/scale.md says env keys are never written
            assert b"env-secret-39" not in p.read_bytes() and b"env-token-39" not in p.read_bytes()
        assert set(_shared_files()) == before
    finally:
        for p in set(_shared_files()) - before:
            p.unlink(missing_ok=True)

"""The command line, in-process (``main([...])``) and as ``python -m blobdata``, against a local S3 server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from blobdata._cache import BlobCache
from blobdata._cli import human_size, main, parse_storage_options, warm
from blobdata._errors import ConfigError
from blobdata._listing import Manifest

_ByteBudget = warm._ByteBudget

pytestmark = pytest.mark.usefixtures("isolated_cache_home")

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("cat", "dog", "eel")


def payload(i: int, size: int = 3000) -> bytes:
    """Distinct bytes per object, so a mixed-up cache entry cannot pass."""
    head = f"object {i};".encode()
    return (head * (size // len(head) + 1))[:size]


def upload(bucket: Any, n: int, prefix: str = "train", size: int = 3000) -> dict[str, bytes]:
    """``n`` objects spread over the classes; returns {url: bytes}."""
    objects = {f"{prefix}/{CLASSES[i % len(CLASSES)]}/{i:04d}.jpg": payload(i, size) for i in range(n)}
    bucket.put_many(objects)
    return {bucket.url(k): v for k, v in objects.items()}


def option_args(opts: dict[str, Any], parent: str = "") -> list[str]:
    """Storage options as ``--storage-option k=v`` arguments (nested dicts as dotted keys)."""
    out: list[str] = []
    for key, value in opts.items():
        name = f"{parent}.{key}" if parent else key
        if isinstance(value, dict):
            out += option_args(value, name)
        else:
            out += [
                "--storage-option",
                f"{name}={json.dumps(value) if not isinstance(value, str) else value}",
            ]
    return out


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def warm(
    capsys: pytest.CaptureFixture[str],
    bucket: Any,
    cache_dir: Path,
    *extra: str,
    opts: dict[str, Any] | None = None,
) -> tuple[int, str, str]:
    """``blobdata warm <bucket>/train --cache-dir D --no-progress EXTRA`` with the bucket's options."""
    argv = ["warm", bucket.url("train"), "--cache-dir", str(cache_dir), "--no-progress", *extra]
    return run(capsys, *argv, *option_args(bucket.storage_options if opts is None else opts))


def delete(bucket: Any, url: str) -> None:
    bucket.delete(url[len(bucket.url("")) :])


def fetched(out: str) -> int:
    match = re.search(r"fetched\s+(\d+) objects", out)
    assert match, out
    return int(match.group(1))


def cached_urls(cache_dir: Path, expected: dict[str, bytes], manifest: Manifest) -> set[str]:
    """URLs of ``manifest`` with a cache entry; each entry present must verify and hold the right bytes."""
    present: set[str] = set()
    with BlobCache(cache_dir) as cache:
        for i in range(len(manifest)):
            url, identity = manifest.url(i), manifest.identity(i)
            if (url, identity) in cache:
                data = cache.get(url, identity)
                assert data == expected[url], f"cache entry of {url} is corrupt or partial"
                present.add(url)
        assert cache.stats().corrupt == 0
    return present


def listing(bucket: Any, prefix: str = "train") -> Manifest:
    from blobdata._listing import load_or_list

    return load_or_list(bucket.url(prefix), storage_options=bucket.storage_options)


# -- warm ----------------------------------------------------------------------------------------


def test_warm_fills_the_cache_and_a_second_run_fetches_nothing(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 40)
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c")
    assert code == 0, err
    assert fetched(out) == 40 and re.search(r"failed\s+0 objects", out)
    assert "MB/s" in out and "40 entries" in out
    assert cached_urls(tmp_path / "c", objects, listing(s3_bucket)) == set(objects)

    code, out, err = warm(capsys, s3_bucket, tmp_path / "c")
    assert code == 0, err
    assert fetched(out) == 0
    assert re.search(r"skipped\s+40 objects already cached", out)


def test_warm_requests_only_what_is_missing(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counted at the wire: a resumed run sends one GET per missing object and nothing for the rest."""
    objects = upload(s3_bucket, 30)
    m = listing(s3_bucket)
    with BlobCache(tmp_path / "c") as cache:  # a previous, partial run
        for i in range(0, 30, 3):
            assert cache.put(m.url(i), m.identity(i), objects[m.url(i)])
    s3_proxy.reset_counts()
    saved = save_manifest(m, tmp_path)
    code, out, err = warm(
        capsys, s3_bucket, tmp_path / "c", "--manifest", saved, opts=s3_proxy.storage_options
    )
    assert code == 0, err
    assert fetched(out) == 20
    # One GET per missing object, and with the saved listing not a single listing request.
    had = {m.url(i) for i in range(0, 30, 3)}
    wanted = sorted("/" + url[len("s3://") :] for url in set(objects) - had)
    requests = s3_proxy.requests
    assert all(method == "GET" for method, _ in requests), requests
    assert sorted(unquote(path.split("?")[0]) for _, path in requests) == wanted
    assert cached_urls(tmp_path / "c", objects, m) == set(objects)


def save_manifest(m: Manifest, tmp_path: Path) -> str:
    path = tmp_path / "saved.manifest"
    m.save(path)
    return str(path)


def test_dry_run_fetches_nothing(s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    upload(s3_bucket, 12, size=10_000)
    code, out, _ = warm(capsys, s3_bucket, tmp_path / "c", "--dry-run")
    assert code == 0
    assert "would fetch 12 of 12 objects (120.00 kB)" in out and "fits in the cache" in out
    assert not (tmp_path / "c").exists()  # a dry run creates nothing
    with BlobCache(tmp_path / "c") as cache:
        assert cache.info()["entries"] == 0

    code, out, _ = warm(capsys, s3_bucket, tmp_path / "d", "--dry-run", "--cache-size", "70kB")
    assert code == 1 and "does NOT fit" in out  # a failure to scripts


def test_rank_split_covers_every_object_exactly_once(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 31)
    m = listing(s3_bucket)
    world = 3
    shares: list[set[str]] = []
    for rank in range(world):
        code, out, err = warm(
            capsys, s3_bucket, tmp_path / f"node{rank}", "--rank", str(rank), "--world-size", "3"
        )
        assert code == 0, err
        assert f"rank {rank} of {world}" in out
        share = cached_urls(tmp_path / f"node{rank}", objects, m)
        assert fetched(out) == len(share)
        assert share == {m.url(i) for i in range(rank, len(m), world)}  # the documented split
        shares.append(share)
    assert sum(len(s) for s in shares) == len(objects)
    assert set().union(*shares) == set(objects)


def test_rank_out_of_range_is_a_usage_error(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = warm(capsys, s3_bucket, tmp_path / "c", "--rank", "2", "--world-size", "2")
    assert code == 2 and "blobdata: error: --rank must be in 0..1" in err


def test_full_cache_stops_admitting_and_says_so(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 30, size=40_000)
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c", "--cache-size", "400kB")
    assert code == 0, err
    n = fetched(out)
    match = re.search(r"cache full: (\d+) objects", out)
    assert match and 0 < n < 30 and n + int(match.group(1)) == 30, out
    assert len(cached_urls(tmp_path / "c", objects, listing(s3_bucket))) == n


def test_failed_objects_are_counted_listed_and_exit_1(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 20)
    m = listing(s3_bucket)  # remembered; then two objects disappear: the listing is stale for them
    gone = [m.url(3), m.url(11)]
    for url in gone:
        delete(s3_bucket, url)
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c")
    assert code == 1, (out, err)
    assert fetched(out) == 18 and re.search(r"failed\s+2 objects", out)
    for url in gone:
        assert url in out
    assert cached_urls(tmp_path / "c", objects, m) == set(objects) - set(gone)


def test_every_object_failing_exits_1_with_the_first_error(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 6)
    listing(s3_bucket)
    for url in objects:
        delete(s3_bucket, url)
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c")
    assert code == 1
    assert re.search(r"failed\s+6 objects", out)
    last = err.strip().splitlines()[-1]
    assert last.startswith("blobdata: error: ") and s3_bucket.url("train/") in last
    assert "Traceback" not in err


def test_byte_budget_bounds_bytes_first_come_first_served() -> None:
    async def scenario() -> tuple[int, list[int]]:
        budget = _ByteBudget(100)
        peak, order = 0, []

        async def hold(n: int) -> None:
            nonlocal peak
            await budget.acquire(n)
            peak = max(peak, budget.used)
            order.append(n)
            await asyncio.sleep(0.01)
            budget.release(n)

        tasks = [asyncio.ensure_future(hold(n)) for n in (40, 40, 41, 250, 10, 60)]
        # A cancelled waiter gives up its place without holding anything.
        cancelled = asyncio.ensure_future(budget.acquire(30))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert budget.used == 0
        return peak, order

    peak, order = asyncio.run(scenario())
    # The 250-byte object runs alone (nothing else fits beside it) and the 10 does not overtake it.
    assert order == [40, 40, 41, 250, 10, 60]
    assert peak == 250


def test_warm_with_a_tiny_buffer_completes(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = upload(s3_bucket, 12, size=5000)
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c", "--buffer-size", "8kB")
    assert code == 0 and fetched(out) == 12, err
    assert cached_urls(tmp_path / "c", objects, listing(s3_bucket)) == set(objects)


# -- errors --------------------------------------------------------------------------------------


def test_bad_url_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "warm", "ftp://host/x", "--cache-dir", str(tmp_path))
    assert code == 2
    assert err.strip() == (
        "blobdata: error: unsupported URL scheme 'ftp' in 'ftp://host/x': use s3://, gs://, gcs://, az://, "
        "abfs://, file://, memory:// or a local path"
    )


def test_bad_size_is_a_usage_error(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = warm(capsys, s3_bucket, tmp_path / "c", "--cache-size", "12QB")
    assert code == 2 and "blobdata: error: --cache-size must be a size such as 100GB" in err


def test_missing_bucket_is_a_runtime_error_without_traceback(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["warm", f"s3://{s3_bucket.name}-missing/train", "--cache-dir", str(tmp_path)]
    code, _, err = run(capsys, *argv, *option_args(s3_bucket.storage_options))
    assert code == 1
    assert err.startswith("blobdata: error: ") and "does not exist" in err and s3_bucket.name in err
    assert len(err.strip().splitlines()) == 1

    code, _, err = run(capsys, *argv, "--debug", *option_args(s3_bucket.storage_options))
    assert code == 1 and "Traceback" in err


def test_refused_credentials_exit_1_and_are_never_printed(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3_bucket, 2)
    opts = {**s3_bucket.storage_options, "secret": "TOPSECRET-do-not-print"}
    for extra in ([], ["--debug"]):
        code, out, err = warm(capsys, s3_bucket, tmp_path / "c", *extra, opts=opts)
        assert code == 1 and "blobdata: error: " in err and "refused" in err
        assert "TOPSECRET" not in out + err


def test_unusable_cache_dir_is_a_runtime_error(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3_bucket, 3)
    (tmp_path / "file").write_text("not a directory")
    code, _, err = warm(capsys, s3_bucket, tmp_path / "file" / "cache")
    assert code == 1 and "blobdata: error: cache directory" in err and "cannot be used" in err


def test_storage_option_parsing() -> None:
    got = parse_storage_options(
        [
            "anon=true",
            "client_kwargs.region_name=eu-west-1",
            'config_kwargs.retries={"a": 1}',
            "secret=123",
            "port=9000",
            "endpoint_url=http://127.0.0.1:1",
        ]
    )
    assert got == {
        "anon": True,
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"a": 1}},
        "secret": "123",  # secret-looking values are never decoded
        "port": 9000,
        "endpoint_url": "http://127.0.0.1:1",
    }
    with pytest.raises(ConfigError) as info:
        parse_storage_options(["hunter2"])
    assert "hunter2" not in str(info.value)
    assert human_size(0) == "0 B" and human_size(123_456_789) == "123.46 MB"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["warm"]) == 2
    assert main(["--help"]) == 0
    assert "warm" in capsys.readouterr().out


# -- cache info / clear, ls ----------------------------------------------------------------------


def test_cache_info_and_clear(s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    upload(s3_bucket, 9)
    cache_dir = tmp_path / "cache"
    assert warm(capsys, s3_bucket, cache_dir)[0] == 0
    code, out, _ = run(capsys, "cache", "info", "--cache-dir", str(cache_dir))
    assert code == 0 and re.search(r"entries:\s+9", out) and str(cache_dir) in out
    code, out, _ = run(
        capsys, "cache", "info", "--cache-dir", str(cache_dir), "--cache-size", "1GB", "--json"
    )
    info = json.loads(out)
    assert info["entries"] == 9 and info["limit"] == 10**9 and 27_000 <= info["bytes"] < info["limit"]
    code, _, err = run(capsys, "cache", "clear", "--cache-dir", str(cache_dir))  # no terminal, no --yes
    assert code == 2 and "--yes" in err
    code, out, _ = run(capsys, "cache", "clear", "--cache-dir", str(cache_dir), "--yes")
    assert code == 0 and "removed 9 entries" in out
    with BlobCache(cache_dir) as cache:
        assert cache.info()["entries"] == 0
    code, _, err = run(capsys, "cache", "info", "--cache-dir", str(tmp_path / "nope"))
    assert code == 1 and "no cache at" in err


def test_ls_text_json_and_saved_manifest(
    s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3_bucket, 10, size=2000)
    opts = option_args(s3_bucket.storage_options)
    code, out, err = run(capsys, "ls", s3_bucket.url("train"), *opts)
    assert code == 0, err
    assert f"{s3_bucket.url('train')}: 3 classes, 10 objects, 20.00 kB" in out
    assert re.search(r"cat\s+4\s+8.00 kB", out) and re.search(r"total\s+10\s+20.00 kB", out)

    saved = tmp_path / "train.manifest"
    code, out, _ = run(capsys, "ls", s3_bucket.url("train"), "--json", "--save-manifest", str(saved), *opts)
    doc = json.loads(out)
    assert doc["objects"] == 10 and doc["bytes"] == 20_000
    rows = [(c["name"], c["objects"], c["bytes"]) for c in doc["classes"]]
    assert rows == [("cat", 4, 8000), ("dog", 3, 6000), ("eel", 3, 6000)]
    m = Manifest.load(saved)
    assert m.root == s3_bucket.url("train") and len(m) == 10

    # Another node warms from the saved listing.
    code, out, err = warm(capsys, s3_bucket, tmp_path / "c", "--manifest", str(saved))
    assert code == 0 and fetched(out) == 10, err
    code, _, err = run(capsys, "ls", s3_bucket.url("other"), "--manifest", str(saved), *opts)
    assert code == 2 and "blobdata: error: manifest" in err


# -- as a program ----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _command(bucket: Any, cache_dir: Path, *extra: str, opts: dict[str, Any] | None = None) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "blobdata",
        "warm",
        bucket.url("train"),
        "--cache-dir",
        str(cache_dir),
        *extra,
    ]
    return argv + option_args(bucket.storage_options if opts is None else opts)


def test_python_dash_m_blobdata(s3_bucket: Any, tmp_path: Path) -> None:
    objects = upload(s3_bucket, 8)
    done = subprocess.run(
        _command(s3_bucket, tmp_path / "c"), env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert fetched(done.stdout) == 8
    assert "warm:" not in done.stderr and "\r" not in done.stderr  # no bar into a pipe (on a terminal only)
    assert cached_urls(tmp_path / "c", objects, listing(s3_bucket)) == set(objects)


def _default_sigint() -> None:
    # A shell without job control starts background jobs with SIGINT ignored, and Python then never
    # raises KeyboardInterrupt: give the child the default disposition, as a terminal would.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_a_resumed_run_completes(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 120
    objects = upload(s3_bucket, n, size=50_000)
    m = listing(s3_bucket)
    cache_dir = tmp_path / "cache"
    s3_proxy.delay = 0.1  # one way: RTT 0.2 s, a slow store, so the run is surely mid-way at SIGINT
    cmd = _command(s3_bucket, cache_dir, "--concurrency", "4", "--no-progress", opts=s3_proxy.storage_options)
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint
    )
    try:
        deadline = time.monotonic() + 60
        entries = 0
        while entries < 8 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if (cache_dir / "cache.db").exists():
                with BlobCache(cache_dir) as cache:
                    entries = int(str(cache.info()["entries"]))
        assert proc.poll() is None, "warm ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert out.startswith("layout: class folders") and "Traceback" not in err
    assert out.splitlines()[1].startswith("interrupted ")
    done = cached_urls(cache_dir, objects, m)  # every entry present is complete and verifies
    assert 8 <= len(done) < n
    assert fetched(out) == len(done)
    assert not list(cache_dir.rglob("*.tmp"))

    s3_proxy.delay = 0.0
    code, out, err = warm(capsys, s3_bucket, cache_dir)
    assert code == 0, err
    assert fetched(out) == n - len(done)
    assert cached_urls(cache_dir, objects, m) == set(objects)

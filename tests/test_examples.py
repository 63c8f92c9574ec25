"""The README's quick start, line by line, and every example, against the local S3 server (issue 11)."""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.network, pytest.mark.slow]


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture
def dataset(s3_bucket: Any) -> tuple[str, dict[str, str]]:
    """A 12-image dataset in a bucket, and the environment a user would set for it."""
    s3_bucket.put_many({f"imagenet/train/n{i % 3:02d}/{i}.JPEG": _jpeg(i) for i in range(12)})
    opts = s3_bucket.storage_options
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AWS_ENDPOINT_URL_S3": opts["endpoint_url"],
        "AWS_ACCESS_KEY_ID": opts["key"],
        "AWS_SECRET_ACCESS_KEY": opts["secret"],
    }
    return s3_bucket.url("imagenet/train"), env


def _run(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=240)
    assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _quick_start_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start on a real bucket\s+```bash\n(.*?)```", text, re.S)
    assert block, "the README's quick start block is gone"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_quick_start_line_by_line(dataset: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = dataset
    lines = _quick_start_lines()
    assert lines[0].startswith("pip install")  # installing is what the test environment did already
    ran = 0
    for line in lines[1:]:
        line = line.replace("s3://bucket/imagenet/train", url)
        line = line.replace("/mnt/nvme/blobdata", str(tmp_path / "c"))
        line = line.replace("--epochs 90", "--epochs 1 --batch-size 4 --workers 0")
        argv = shlex.split(line)
        if argv[0] == "blobdata":
            argv = [sys.executable, "-m", "blobdata", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        out = _run(argv, env)
        ran += 1
        if "ls" in argv:
            assert "12" in out
        if "train_resnet.py" in line:
            assert "epoch 0: 12 images" in out
    assert ran == 3


def test_quickstart_example(dataset: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    url, env = dataset
    out = _run([sys.executable, "examples/quickstart.py", url, "--endpoint-url", env["AWS_ENDPOINT_URL_S3"],
                "--workers", "0", "--batch-size", "5", "--cache-dir", str(tmp_path / "c")], env)  # fmt: skip
    assert "epoch 0" in out


def test_train_resnet_with_a_dataset_smaller_than_a_batch(dataset: tuple[str, dict[str, str]]) -> None:
    url, env = dataset
    # Before: UnboundLocalError (loss) when drop_last left no batch at all.
    out = _run([sys.executable, "examples/train_resnet.py", url, "--endpoint-url", env["AWS_ENDPOINT_URL_S3"],
                "--workers", "0", "--batch-size", "64"], env)  # fmt: skip
    assert "epoch 0: 12 images" in out


def test_train_resnet_with_the_device_decode_path(dataset: tuple[str, dict[str, str]]) -> None:
    url, env = dataset
    # --decode gpu: workers fetch bytes, the training process decodes and transforms whole batches
    # (on the CPU here, where there is no CUDA: the same path, the same loop).
    out = _run([sys.executable, "examples/train_resnet.py", url, "--endpoint-url", env["AWS_ENDPOINT_URL_S3"],
                "--workers", "2", "--batch-size", "4", "--decode", "gpu"], env)  # fmt: skip
    assert "epoch 0: 12 images" in out


def test_package_builds_as_wheel_and_sdist(tmp_path: Path) -> None:
    """The build metadata is ready to publish: sdist and wheel build from a clean copy of the tree."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    src = tmp_path / "src"
    for name in files.splitlines():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = tmp_path / "dist"
    for hook in ("build_wheel", "build_sdist"):  # what `python -m build` calls, one process each
        code = f"from setuptools import build_meta as b; import sys; print(b.{hook}(sys.argv[1]))"
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True,
                              text=True, timeout=240)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    wheel = next(out.glob("blobdata-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("blobdata/py.typed", "blobdata/_stores/s3/reader.py", "blobdata/_cache/cache.py",
                 "blobdata/_cache/db.py", "blobdata/gpu/_pipeline.py"):  # fmt: skip
        assert name in names, name
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Name: blobdata" in text and "Requires-Dist: torch" in text
    runtime = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert not [line for line in runtime if "diskcache" in line]  # the cache owns its SQLite schema
    sdists = list(out.glob("*.tar.gz"))
    assert sdists and sdists[0].stat().st_size > 10_000, (sorted(p.name for p in out.iterdir()), done.stdout)


def test_train_resnet_help_explains_every_option() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "examples/train_resnet.py", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    options = re.findall(r"^  (--[a-z-]+)", done.stdout, re.M)
    assert {"--steps", "--limit", "--model", "--cache-size", "--log-every"} <= set(options), done.stdout
    # Every option has its help text: argparse prints an option without help alone on its line.
    bare = re.findall(r"^  (--[a-z-]+(?: [A-Z_]+)?)\n(?!   )", done.stdout, re.M)
    assert not bare, f"options without help: {bare}"
    assert "(default: None)" not in done.stdout


def test_train_resnet_short_run_prints_progress_per_step(
    dataset: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = dataset
    out = _run([sys.executable, "examples/train_resnet.py", url, "--endpoint-url", env["AWS_ENDPOINT_URL_S3"],
                "--model", "small", "--workers", "0", "--batch-size", "2", "--limit", "8", "--steps", "3",
                "--log-every", "1", "--epochs", "5", "--cache-dir", str(tmp_path / "c")], env)  # fmt: skip
    assert "8 images in 3 classes" in out  # --limit: a subset of the 12
    steps = re.findall(
        r"^epoch 0 step (\d+): \d+ images/s, data wait \d+% \(\d+ ms/step\), loss [\d.]+$", out, re.M
    )
    assert steps == ["1", "2", "3"], out  # --steps 3 stops the run, --epochs 5 notwithstanding
    assert "epoch 1" not in out
    assert "epoch 0: 6 images" in out and "data so far: 6 samples served" in out, out


def test_the_mixing_example_on_the_test_kits_server() -> None:
    """examples/mixing.py --demo: two folders on the kit's S3 server and one on local disk, weights 3, 1,
    2: each epoch reads exactly 36, 12 and 24 of its 72 samples, and the summary names each source."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = _run([sys.executable, "examples/mixing.py", "--demo"], env)
    assert "Mixture({web: 3, coco: 1, curated: 2}, samples_per_epoch=72, seed=0)" in out
    for epoch in (0, 1):
        said = rf"epoch {epoch}: web 36 samples, .*, coco 12 samples, .*, curated 24 samples"
        assert re.search(said, out), out
    assert "sources: web: 72 samples (50%)" in out and "coco: 24 samples (17%)" in out

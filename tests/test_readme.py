"""The README stays short, its links lead somewhere, and its local section runs as written (issue 30)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from blobdata.testing.serve import next_commands

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"the README has no section {title!r}"
    return match.group(1)


def _commands(block: str) -> list[str]:
    """The shell lines of a block: comments cut, continuation lines joined."""
    text = re.sub(r"\s*\\\n\s*", " ", block)
    return [
        line.split("  #")[0].strip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def test_readme_is_short_and_its_links_exist() -> None:
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"
    # The test command it gives is what CI runs.
    assert "bash scripts/test.sh" in _section("The two commands")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_blobdataset_examples_are_linked_from_the_readme_and_the_layouts_page() -> None:
    """Issue 40: the three BlobDataset examples were linked from neither."""
    layouts = (ROOT / "docs" / "layouts.md").read_text()
    for name in ("image_caption_pairs.py", "segmentation_metadata.py", "detection_coco_index.py"):
        assert (ROOT / "examples" / name).is_file()
        assert f"](examples/{name})" in README, name
        assert f"`examples/{name}`" in layouts, name


def test_readme_local_commands_are_what_serve_prints() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", _section("Try it locally"), re.S)
    pasted = [c for c in _commands(blocks[1]) if not c.startswith(("source ", "export "))]
    assert pasted == next_commands("s3://demo/train", "/tmp/blobdata-demo-cache")


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_local_section_end_to_end(tmp_path: Path) -> None:
    """Server, ls, warm, a training run and bench, as pasted from the README (a smaller dataset)."""
    blocks = re.findall(r"```bash\n(.*?)```", _section("Try it locally"), re.S)
    serve = next(c for c in _commands(blocks[0]) if c.startswith("blobdata serve"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BLOBDATA_TEST_"))}
    env.update(PYTHONPATH=str(ROOT), BLOBDATA_CACHE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    backend = os.environ.get("BLOBDATA_TEST_S3_SERVER", "seaweedfs")
    argv = [sys.executable, "-m", "blobdata", *shlex.split(serve)[1:], "--images", "48", "--classes", "3",
            "--backend", backend]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        from test_serve import _read_until

        printed = _read_until(proc, "Serving until Ctrl-C", timeout_s=120)
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in printed.splitlines()
            if line.startswith("export ")
        )
        cache = str(tmp_path / "cache")
        for command in _commands(blocks[1]):
            if command.startswith(("source ", "export ")):
                continue
            command = command.replace("/tmp/blobdata-demo-cache", cache)
            if "train_resnet.py" in command:  # 48 images make 1 step per epoch: 3 steps, a line each
                command = command.replace("--steps 20", "--steps 3") + " --log-every 1"
            args = shlex.split(command)
            args = (
                [sys.executable, "-m", "blobdata", *args[1:]]
                if args[0] == "blobdata"
                else [sys.executable, *args[1:]]
            )
            done = subprocess.run(
                args, cwd=ROOT, env={**env, **exports}, capture_output=True, text=True, timeout=240
            )
            assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
            if " ls " in f" {command} ":
                assert "3 classes, 48 objects" in done.stdout
            if " warm " in f" {command} ":
                assert "fetched  48 objects" in done.stdout
            if "train_resnet.py" in command:
                assert "epoch 2 step 3: " in done.stdout, done.stdout  # --steps: as many epochs as needed
            if " bench " in f" {command} ":
                assert "verdict" in done.stdout and "hit rate 100%" in done.stdout
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0


def _own_folder(root: Path, n: int) -> None:
    """A folder of image-caption pairs, as a user's own."""
    import io

    from PIL import Image

    root.mkdir()
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (48, 40), (20 * i % 256, 90, 160)).save(buf, "JPEG")
        (root / f"{i:04d}.jpg").write_bytes(buf.getvalue())
        (root / f"{i:04d}.txt").write_text(f"picture number {i}")


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_your_own_folder_walk_through_end_to_end(tmp_path: Path) -> None:
    """docs/guides/local.md's "Your own folder", as pasted: serve --data, ls, warm, bench, the example."""
    guide = (ROOT / "docs" / "guides" / "local.md").read_text()
    section = re.search(r"^## Your own folder\n(.*?)(?=^## |\Z)", guide, re.S | re.M)
    assert section, "docs/guides/local.md has no section 'Your own folder'"
    blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
    (serve,) = _commands(blocks[0])
    _own_folder(tmp_path / "pairs", 12)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "BLOBDATA_TEST_"))}
    env.update(PYTHONPATH=str(ROOT), BLOBDATA_CACHE_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    backend = os.environ.get("BLOBDATA_TEST_S3_SERVER", "seaweedfs")
    argv = [sys.executable, "-m", "blobdata", *shlex.split(serve)[1:], "--backend", backend]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        from test_serve import _read_until

        printed = _read_until(proc, "Serving until Ctrl-C", timeout_s=120)
        assert "uploaded 24 files" in printed and "to s3://demo/pairs" in printed, printed
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in printed.splitlines()
            if line.startswith("export ")
        )
        cache = str(tmp_path / "cache")
        said = {}
        for command in _commands(blocks[1]):
            assert command in printed or command.startswith("python "), f"serve does not print {command!r}"
            command = command.replace("/tmp/blobdata-demo-cache", cache).replace(
                "--batches 20", "--batches 3"
            )
            args = shlex.split(command)
            args = [sys.executable, *(["-m", "blobdata"] if args[0] == "blobdata" else []), *args[1:]]
            done = subprocess.run(
                args, cwd=ROOT, env={**env, **exports}, capture_output=True, text=True, timeout=240
            )
            assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
            said[shlex.split(command)[1]] = done.stdout
        assert "layout: samples by file name" in said["ls"] and "12 samples, 24 objects" in said["ls"]
        assert "fetched  24 objects" in said["warm"]
        assert "samples in " in said["bench"] and "hit rate 100%" in said["bench"]
        example = said["examples/image_caption_pairs.py"]
        assert "12 pairs in s3://demo/pairs" in example and "epoch 1: 12 pairs" in example, example
        assert "; 0 GETs so far, 24 objects from the cache" in example  # warmed: every member was
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0

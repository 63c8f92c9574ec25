"""The BlobDataset examples (detection via an index, image-caption pairs, segmentation with a metadata
file) run end to end with ``--demo``: each on the test kit's S3 server, with synthetic data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.network, pytest.mark.slow]


def _demo(name: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), "--demo"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, f"{name} --demo failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_image_caption_pairs() -> None:
    out = _demo("image_caption_pairs.py")
    assert "40 pairs in s3://demo/pairs" in out
    assert "epoch 0: 40 pairs, images (3, 32, 32)" in out
    assert "80 GETs so far, 0 objects from the cache" in out  # a GET per member
    # Epoch 2 reads every member once, from the cache as far as its writes (off the hot path) are done.
    found = re.search(r"epoch 1: 40 pairs.*; (\d+) GETs so far, (\d+) objects from the cache", out)
    assert found and int(found[1]) + int(found[2]) == 160, out


def test_segmentation_with_metadata() -> None:
    out = _demo("segmentation_metadata.py")
    assert "16 image/mask pairs" in out and "16 samples, images (3, 24, 32), masks (24, 32)" in out


def test_detection_through_an_index() -> None:
    out = _demo("detection_coco_index.py")
    assert "20 images in s3://demo/coco/train, from the annotations (no listing)" in out
    assert "20 images, 50 boxes; 20 GETs" in out

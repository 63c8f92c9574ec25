"""benchmarks/bench_gpu.py --dry-run: every row of the GPU benchmark runs on the CPU and is printed and saved.

The figures themselves need a CUDA machine; this checks the script, the server, the proxy and each
input path end to end (the GPU rows run the loader's device path with device="cpu")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["synthetic (ceiling)", "local, CPU decode", "blobdata CPU cold", "blobdata CPU warm",
        "blobdata CPU cold, cheaper crop", "blobdata CPU warm, cheaper crop",
        "blobdata GPU cold", "blobdata GPU warm"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(300)
def test_dry_run_prints_and_saves_every_row(tmp_path: Path) -> None:
    save = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/bench_gpu.py", "--dry-run", "--images", "96", "--rtt", "20",
           "--save", str(save)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("=====")[-1]
    for name in ROWS:
        assert name in table, name
    rows = json.loads(save.read_text())["rows"]
    assert [r["row"] for r in rows] == ROWS
    assert all(r["images"] == 96 and r["rate"] > 0 and 0 <= r["wait"] <= 1 for r in rows[1:])
    assert all(r["trainer_cpu_ms"] > 0 for r in rows), [r["trainer_cpu_ms"] for r in rows]
    assert rows[0]["images"] == 96  # the ceiling: as many (synthetic) images as the dataset has
    for cold in (2, 4, 6):  # each blobdata row: cold from the bucket, then warm from its cache
        assert rows[cold]["hit_rate"] == 0.0 and rows[cold + 1]["hit_rate"] == 1.0, rows[cold]["row"]


@pytest.mark.timeout(120)
def test_decode_and_transform_benchmark_runs_on_the_cpu() -> None:
    cmd = [sys.executable, "benchmarks/bench_gpu_decode.py", "--device", "cpu", "--images", "24",
           "--batch", "8", "--repeat", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "batches of 8, on cpu" in lines[0] and "decoder: Pillow" in lines[0]
    rates = dict(re.findall(r"^  (\S.*?) +(\d+) images/s", done.stdout, flags=re.M))
    assert list(rates) == ["decode", "TrainTransform", "decode + TrainTransform"], done.stdout
    assert all(int(r) > 0 for r in rates.values()), rates
    assert "mean abs difference 0.00/255" in lines[-1]  # the same decoder on both sides

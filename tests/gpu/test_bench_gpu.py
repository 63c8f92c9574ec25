"""``GPU_NODE_SMOKE=1 bash benchmarks/gpu_node.sh``: every stage of the GPU run, tiny, on the CPU.

The figures themselves need a CUDA machine; this checks the script, bench_gpu.py's stages (the image
mix, the decode rows with a trainer beside them, the synthetic ceiling, the in-memory pipeline, local
CPU decode, the bucket cold and warm through the server and the proxy) and bench_gpu_decode.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["versions", "images", "decode", "synthetic", "in_memory", "local_cpu", "bucket_cold", "bucket_warm"]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(300)
def test_the_gpu_node_smoke_run_writes_every_stage(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_NODE_SMOKE": "1", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "benchmarks/gpu_node.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_node.json").read_text())
    stages = result["stages"]
    assert list(stages) == STAGES
    assert not [k for k, v in stages.items() if "error" in v or "skipped" in v], stages
    assert stages["versions"]["torch"] and "nvidia.nvimgcodec" in stages["versions"]
    assert sum(stages["images"]["kinds"].values()) == 48 and len(stages["images"]["kinds"]) >= 5
    for beside in ("gpu_idle", "with_resnet50_training"):
        row = stages["decode"][beside]["gpu"]
        assert row["decode"]["images_per_s"] > 0 and row["decode"]["cpu_ms_per_image"] > 0
        assert row["refused"] == 0 and row["mean_abs_diff_vs_pillow"] == 0.0
    assert stages["decode"]["trainer_beside"]["steps"] > 0  # it trained while the decode was measured
    assert stages["synthetic"]["images"] == 3 * 8 and stages["synthetic"]["x_ceiling"] == 1.0
    assert stages["in_memory"]["images"] == 3 * 8
    for name in ("in_memory", "local_cpu", "bucket_cold", "bucket_warm"):
        assert stages[name]["images_per_s"] > 0 and 0 <= stages[name]["wait"] <= 1, name
        assert stages[name]["trainer_cpu_ms_per_image"] > 0 and stages[name]["x_ceiling"] > 0, name
    assert stages["bucket_cold"]["hit_rate"] == 0.0 and stages["bucket_warm"]["hit_rate"] == 1.0
    cold = stages["bucket_cold"]
    assert cold["device_decoded"] + cold["worker_decoded"] == cold["images"]  # PNG/CMYK in the workers
    assert (tmp_path / "bench-gpu.txt").read_text().count("== ") == len(STAGES)


@pytest.mark.timeout(120)
def test_decode_and_transform_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "benchmarks/bench_gpu_decode.py", "--device", "cpu", "--images", "24",
           "--batch", "8", "--repeat", "1", "--size", "32", "--json", str(tmp_path / "r.json")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "batches of 8, on cpu" in lines[0] and "decoder: Pillow" in lines[0]
    rates = dict(
        re.findall(r"^  (\S.*?) +(\d+) images/s +(?:\d+\.\d+) CPU ms/image", done.stdout, flags=re.M)
    )
    assert list(rates) == [
        "samples() views", "samples() + .tobytes() (before)", "draw_keyed (vectorised)",
        "draw per sample (before)", "decode", "TrainTransform.apply", "all: samples, decode, draw, transform",
    ], done.stdout  # fmt: skip
    assert all(int(r) > 0 for r in rates.values()), rates
    assert "mean abs difference 0.00/255" in lines[-1]  # the same decoder on both sides
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["images"] == 24 and saved["rows"]["decode"]["cpu_ms_per_image"] > 0

"""``blobdata bench``: on a local folder and on the S3 server, text, JSON and a plot that shows its
curves; the verdict follows the situation (decode-bound vs latency-bound)."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from blobdata._cli import main, run_bench
from tests.cli.test_cli import option_args

pytestmark = pytest.mark.timeout(180)


def _png(i: int, side: int = 40) -> bytes:
    arr = np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _objects(n: int, prefix: str = "b") -> dict[str, bytes]:
    return {f"{prefix}/c{i % 2}/{i:03d}.png": _png(i) for i in range(n)}


def _folder(root: Path, n: int) -> Path:
    for key, data in _objects(n).items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root / "b"


class Expensive:
    """A transform that costs ~4 ms of CPU per sample (picklable, for workers)."""

    def __call__(self, img: Any) -> Any:
        end = time.process_time() + 0.004
        while time.process_time() < end:
            pass
        import torch

        return torch.zeros(1)


def test_bench_local_folder_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(_folder(tmp_path, 24))
    argv = ["bench", url, "--batches", "5", "--batch-size", "8", "--workers", "0", "--transform", "none"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["images"] == 8 * 5 - 0 and doc["settings"]["workers"] == 0
    assert doc["verdict"] in ("decode-bound", "latency-bound") and doc["advice"]
    assert set(doc["per_sample_ms"]) == {"fetch", "cache", "decode", "transform", "collate"}
    assert doc["per_sample_ms"]["decode"] > 0 and doc["stats"]["samples"] >= 40
    assert doc["images_per_s"] > 0 and doc["mb_per_s"] > 0 and doc["timeline"]
    # Text, with the built-in transform.
    assert main(["bench", url, "--batches", "3", "--batch-size", "8", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "img/s" in out and "per sample (ms" in out and "verdict:" in out and "transform train" in out


def _colour_pixels(path: Path, rgb: tuple[int, int, int]) -> int:
    arr = np.asarray(Image.open(path).convert("RGB")).astype(np.int16)
    return int((np.abs(arr - np.array(rgb)).sum(axis=2) < 40).sum())


@pytest.mark.network
def test_bench_on_s3_with_plot(s3_bucket: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s3_bucket.put_many(_objects(48))
    png = tmp_path / "bench.png"
    opts = option_args(s3_bucket.storage_options)
    argv = ["bench", s3_bucket.url("b"), *opts, "--batches", "18", "--batch-size", "8", "--workers", "2"]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, *cache, "--json"]) == 0  # fills the cache
    first = json.loads(capsys.readouterr().out)
    assert main([*argv, *cache, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"plot: {png}" in out and "hit rate" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The curves are drawn: the throughput line (tab:blue) and the hit-rate line (tab:green).
    assert _colour_pixels(png, (31, 119, 180)) > 200
    assert _colour_pixels(png, (44, 160, 44)) > 200
    assert first["images"] == 18 * 8 and first["stats"]["gets"] > 0
    assert "hit rate 100%" in out  # the second run read everything from the cache


def test_verdict_decode_bound(tmp_path: Path) -> None:
    url = str(_folder(tmp_path, 16))
    r = run_bench(url, batches=4, batch_size=8, workers=0, transform=Expensive(), lookahead=64)
    assert r.verdict == "decode-bound", r.report()
    assert any("is the limit" in a and "GPU" in a for a in r.advice)
    assert any("more workers would help" in a for a in r.advice) or r.settings["cores"] <= 1
    assert not any("raise lookahead" in a for a in r.advice)
    ms = r.per_sample_ms()
    assert ms["transform"] > 5 * ms["fetch"]


@pytest.mark.network
def test_verdict_latency_bound(s3_bucket: Any, s3_proxy: Any) -> None:
    s3_bucket.put_many(_objects(16))
    s3_proxy.delay = 0.04  # one way: RTT 80 ms per GET, and nothing fetched ahead
    r = run_bench(
        s3_bucket.url("b"),
        batches=4,
        batch_size=4,
        workers=0,
        lookahead=0,
        storage_options=s3_proxy.storage_options,
    )
    assert r.verdict == "latency-bound", r.report()
    assert any("raise lookahead (now 0)" in a for a in r.advice)
    ms = r.per_sample_ms()
    assert ms["fetch"] > 5 * ms["decode"]
    assert r.stats.get_p50_s > 0.06  # at least the RTT the proxy adds (80 ms, less a bucket's width)


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from blobdata import ConfigError, LoaderStats
    from blobdata._cli import BenchResult, plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    result = BenchResult({"url": "x"}, 0, 0.0, LoaderStats(), [], "unknown", [])
    with pytest.raises(ConfigError, match=r"blobdata\[plot\]"):
        plot(result, str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()

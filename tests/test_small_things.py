"""Small things a newcomer reads (issue 30): the dataset's repr and bench's advice use today's names."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

from blobdata import FolderDataset, LoaderStats
from blobdata._cli import advise


def test_repr_shows_cache_not_the_deprecated_cache_dir(tmp_path: Path) -> None:
    (tmp_path / "d" / "cat").mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "JPEG")
    (tmp_path / "d" / "cat" / "a.jpg").write_bytes(buf.getvalue())
    text = repr(FolderDataset(tmp_path / "d", cache=tmp_path / "c"))
    assert f"cache=BlobCache('{tmp_path / 'c'}'" in text, text
    assert "cache_dir" not in text and "cache_size" not in text
    assert "cache=" not in repr(FolderDataset(tmp_path / "d"))


def test_bench_advises_cache_dir_and_cache_not_the_deprecated_name() -> None:
    stats = LoaderStats(samples=100, samples_from_bucket=100, elapsed_s=1.0, loop_wait_s=0.05,
                        wait_fraction=0.05, decode_s_per_sample=0.003)  # fmt: skip
    _, advice = advise(stats, workers=2, lookahead=1024, cache_dir=None, ncores=2)
    line = next(a for a in advice if a.startswith("no cache"))
    assert "--cache-dir" in line and "cache=" in line and "cache_dir" not in line, line

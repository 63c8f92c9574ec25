"""Every Python example of docs/layouts.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "layouts.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_an_example_per_layout() -> None:
    assert len(BLOCKS) >= 5


# An example that starts the test kit's S3 server carries the network mark (tests/test_markers.py).
PARAMS = [
    pytest.param(code, id=f"block{i}", marks=[pytest.mark.network] if "LocalS3Server" in code else [])
    for i, code in enumerate(BLOCKS)
]


@pytest.mark.parametrize("code", PARAMS)
def test_doc_example_runs(code: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
    out = capsys.readouterr().out
    assert out.strip(), "each example prints what it shows"

"""Names from a bucket never reach the terminal raw: ``blobdata ls`` and the log lines escape what is
not printable (issue 29, finding 7)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from blobdata._cli import main

EVIL = "evil\x1b[2J\x1b]0;pwned\x07\nforged 999 objects\u202e"


def _folder(tmp_path: Path, root_name: str = "data") -> Path:
    root = tmp_path / root_name
    for cls in ("cat", EVIL):
        (root / cls).mkdir(parents=True)
        (root / cls / "a.png").write_bytes(b"x" * 10)
    return root


def test_ls_escapes_class_names_in_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _folder(tmp_path)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert not any(line.startswith("forged") for line in out.splitlines())  # no forged output line
    assert "evil\\x1b[2J\\x1b]0;pwned\\x07\\nforged 999 objects\\u202e" in out
    assert len(out.splitlines()) == 6  # the layout, header, column names, 2 classes, total


def test_ls_json_keeps_the_exact_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _folder(tmp_path)
    assert main(["ls", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert EVIL in [c["name"] for c in doc["classes"]]  # machine output: exact, JSON-escaped


def test_log_lines_escape_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _folder(tmp_path, "root\x1b[2Jname\nforged")
    assert main(["--debug", "warm", str(root), "--cache-dir", str(tmp_path / "c"), "--dry-run", "-q"]) == 0
    err = capsys.readouterr().err
    assert "root\\x1b[2Jname\\nforged" in err  # the listing's debug line names the root, escaped
    assert "\x1b" not in err
    assert all(line.startswith(("blobdata: ", "  ", "Traceback")) for line in err.splitlines() if line)


def test_the_skipped_sample_warning_escapes_the_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from blobdata import FolderDataset

    root = tmp_path / "data"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "bad\x1b[2J\nforged.png").write_bytes(b"not an image")
    ds = FolderDataset(str(root), on_error="skip")
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        assert ds.__getitems__([0]) == []
    lines = [r.getMessage() for r in caplog.records if "skipped bad sample" in r.getMessage()]
    assert lines and "bad\\x1b[2J\\nforged.png" in lines[0]
    assert "\x1b" not in lines[0] and "\n" not in lines[0]


# -- issue 39, row 12: warm's failure lines and the one-line error -------------------------------------


def _index_with_a_missing_evil_key(tmp_path: Path, good: bool) -> tuple[Path, Path]:
    root = tmp_path / "data"
    root.mkdir()
    (root / "a.png").write_bytes(b"x" * 10)
    index = tmp_path / "index.jsonl"
    rows = ([{"key": "a.png"}] if good else []) + [{"key": "bad\x1b[2J\nforged 0 failed.png"}]
    index.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, index


def test_warm_failure_lines_escape_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, index = _index_with_a_missing_evil_key(tmp_path, good=True)
    code = main(["warm", str(root), "--index", str(index), "--cache-dir", str(tmp_path / "c"), "-q"])
    assert code == 1  # one object failed
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert not any(line.startswith("forged") for line in out.splitlines())  # no forged summary line
    assert "bad\\x1b[2J\\nforged 0 failed.png" in out


def test_the_one_line_error_escapes_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, index = _index_with_a_missing_evil_key(tmp_path, good=False)
    code = main(["warm", str(root), "--index", str(index), "--cache-dir", str(tmp_path / "c"), "-q"])
    assert code == 1  # every object failed: the first error, as one line
    err = capsys.readouterr().err
    assert "\x1b" not in err and "bad\\x1b[2J\\nforged 0 failed.png" in err
    assert [line for line in err.splitlines() if line] == [err.strip()]


def test_the_library_log_line_of_keys_without_extension_escapes_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from blobdata import BlobDataset

    root = tmp_path / "data"
    root.mkdir()
    (root / "a.txt").write_bytes(b"a")
    (root / "bad\x1b[2J\nforged").write_bytes(b"no extension: no sample")
    with caplog.at_level(logging.INFO, logger="blobdata"):
        BlobDataset(str(root)).close()
    [line] = [r.getMessage() for r in caplog.records if "have no extension" in r.getMessage()]
    assert "bad\\x1b[2J\\nforged" in line and "\x1b" not in line and "\n" not in line

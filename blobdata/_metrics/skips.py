"""Skipped samples reported across processes: a DataLoader worker's ``on_error="skip"`` reports reach the
training process's ``dataset.errors``.

Each worker appends one JSON line per skipped sample (URL, error class, message) to its own file in the
loader's private plan directory (``/dev/shm``, mode 0700); the training process reads the new lines
after each batch it receives, so ``ds.errors`` holds every skip whatever the number of workers, with
fork, spawn and persistent workers. JSON only: nothing read back is unpickled, and an error class is
rebuilt only from blobdata's own hierarchy.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from .. import _errors, _process
from .._errors import BlobdataError

__all__ = ["SkipLog"]

_PREFIX = "skipped-"


def _error_class(name: str) -> type[BlobdataError]:
    cls = getattr(_errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BlobdataError) else BlobdataError


class SkipLog:
    """The skip reports of one loader, in its plan directory ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offsets: dict[str, int] = {}

    def record(self, url: str, exc: BlobdataError) -> None:
        """Append one report (called in the worker that skipped the sample)."""
        line = json.dumps({"url": url, "error": type(exc).__name__, "message": str(exc)}) + "\n"
        target = os.path.join(self.path, f"{_PREFIX}{_process.pid()}.jsonl")
        with contextlib.suppress(OSError):  # the loader is gone: nobody is left to read it
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def drain(self) -> list[tuple[str, BlobdataError]]:
        """The reports written since the last call (called in the training process)."""
        out: list[tuple[str, BlobdataError]] = []
        try:
            names = sorted(n for n in os.listdir(self.path) if n.startswith(_PREFIX))
        except OSError:
            return out
        for name in names:
            start = self._offsets.get(name, 0)
            try:
                with open(os.path.join(self.path, name), "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self._offsets[name] = start + len(complete)
            for raw in complete.splitlines():
                item = _parse(raw)
                if item is not None:
                    out.append(item)
        return out


def _parse(raw: bytes) -> tuple[str, BlobdataError] | None:
    try:
        item: Any = json.loads(raw)
        url, name, message = str(item["url"]), str(item["error"]), str(item["message"])
    except (ValueError, KeyError, TypeError):
        return None
    return url, _error_class(name)(message, url)

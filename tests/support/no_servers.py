"""A pytest plugin that reports every server process a run starts: ``-p tests.support.no_servers``.

It wraps :meth:`blobdata.testing.servers._ServerProcess.start` (S3, moto, Azurite, the GCS
emulator: every server the suite starts), prints ``servers started: <names>`` (or ``none``) at the
end of the run, and makes the run fail when any started. ``tests/test_markers.py`` runs the suite
with it under ``-m "not network"``.
"""

from __future__ import annotations

from typing import Any

import pytest

from blobdata.testing import servers

_started: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    original = servers._ServerProcess.start

    def start(self: servers._ServerProcess, *args: Any, **kwargs: Any) -> None:
        _started.append(self.name)
        original(self, *args, **kwargs)

    servers._ServerProcess.start = start  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _started:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"servers started: {', '.join(_started) or 'none'}")

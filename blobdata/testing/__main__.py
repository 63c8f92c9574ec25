"""``python -m blobdata.testing serve [--demo]``: a local S3 server until Ctrl-C (see :mod:`.serve`)."""

from __future__ import annotations

import sys

from .serve import main


def _run(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        print("usage: python -m blobdata.testing serve [--demo] [--help]", file=sys.stderr)
        return 2
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(_run(sys.argv[1:]))

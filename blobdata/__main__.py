"""``python -m blobdata``: the same command line as the ``blobdata`` console script."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())

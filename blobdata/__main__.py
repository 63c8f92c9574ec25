"""``python -m blobdata``: the same command line as the ``blobdata`` console script."""

from __future__ import annotations

from ._cli import entry

if __name__ == "__main__":
    entry()

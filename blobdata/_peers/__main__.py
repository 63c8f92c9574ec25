"""``python -m blobdata._peers ANSWERS_FD STATS_FD PARENT_PID``: a node's peer service in a process
of its own, started by :func:`blobdata._peers.daemon.start` (not a command for people)."""

import sys

from .daemon import main

if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))

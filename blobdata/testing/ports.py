"""Ports for servers that a process starts after they were chosen (the kit's own servers, torchrun's
store, a node's peer service).

A port found by binding port 0 and closing the socket lies in the kernel's ephemeral range, which the
kernel also hands out as the local port of every outgoing connection: between the choice and the
listen, any connection on the machine may take it, and the server fails with EADDRINUSE (seen in
this project's CI: a torchrun's store could not listen on 49109). Below that range the kernel never
assigns a port by itself. So a port is drawn at random there, checked free, and never handed out
twice by one process; under pytest-xdist each worker draws in a slice of its own, so two workers of
a run never draw the same port.
"""

from __future__ import annotations

import os
import random
import socket
import threading

__all__ = ["find_free_port", "free_ports"]

_LOW = 10_000  # above the well-known and registered services' usual ports
_DRAWS = 200
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    """This process's ports: below the ephemeral range, a part of its own under pytest-xdist."""
    high = max(_ephemeral_low(), _LOW + 1024)
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    try:
        count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        count = 1
    worker = int(name[2:]) if name[2:].isdigit() else 0
    span = (high - _LOW) // count
    start = _LOW + (worker % count) * span
    return range(start, start + span)


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port still in TIME_WAIT is refused too
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports on 127.0.0.1, free now and below the ephemeral range (see the module
    docstring). Raises RuntimeError if the range has too few free ones."""
    ports = _slice()
    out: list[int] = []
    with _lock:
        for _ in range(_DRAWS * n):
            if len(out) == n:
                break
            port = random.choice(ports)
            if port not in _given and _bindable(port):
                _given.add(port)
                out.append(port)
    if len(out) < n:
        raise RuntimeError(f"fewer than {n} free ports found in 127.0.0.1:{ports.start}-{ports.stop - 1}")
    return out


def find_free_port() -> int:
    """A port on 127.0.0.1 that is free now, below the ephemeral range, for a server that binds it
    later (see the module docstring)."""
    return free_ports(1)[0]

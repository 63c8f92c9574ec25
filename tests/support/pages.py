"""How much of a file is in the page cache (``mincore``), and dropping it from there (``posix_fadvise``):
what a node's share costs it, measured (tests/listing/test_share.py, benchmarks/bench_scale.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
PAGE = mmap.PAGESIZE


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``): mapped without touching, asked of mincore."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = -(-size // PAGE)
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw), pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cached(path: str) -> None:
    """Drop ``path``'s clean pages from the page cache (as after a reboot, for this file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

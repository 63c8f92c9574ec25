"""Progress bars on stderr for long work: listing a bucket, downloading a manifest (``warm`` has its own,
whose postfix is a :class:`RequestsLine`).

``progress=None`` (the default everywhere) shows a bar only when stderr is a terminal, and only once
the work has lasted half a second; ``False`` (the command line's ``--quiet``) never shows one.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["RequestsLine", "bar", "download", "enabled"]

#: Bytes per read of a manifest download with a bar.
_CHUNK = 8 * 1024 * 1024


def enabled(progress: bool | None) -> bool:
    """Whether to show a bar: as asked, else when stderr is a terminal."""
    if progress is not None:
        return progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def bar(*, desc: str, total: int | None, unit: str, progress: bool | None, scale: bool = False) -> Any:
    """A tqdm bar on stderr (disabled per :func:`enabled`; drawn after 0.5 s, removed when done)."""
    from tqdm import tqdm

    return tqdm(
        desc=desc, total=total, unit=unit, unit_scale=scale, file=sys.stderr, delay=0.5, leave=False,
        disable=not enabled(progress), dynamic_ncols=True,
    )  # fmt: skip


def download(fs: Any, path: str, desc: str, progress: bool | None) -> bytes:
    """The bytes of ``path`` read through the (synchronous API of the) fsspec filesystem ``fs`` in
    chunks, with a byte bar; call from a thread other than blobdata's loop."""
    out = bytearray()
    with fs.open(path, "rb", block_size=_CHUNK) as fh:
        size = getattr(fh, "size", None)
        with bar(desc=desc, total=size, unit="B", progress=progress, scale=True) as b:
            while chunk := fh.read(_CHUNK):
                out += chunk
                b.update(len(chunk))
    return bytes(out)


class RequestsLine:
    """What a bar's postfix says of this process's requests since it was made: in flight now, and
    the store's throttling (answers throttled, the rate the node's controller allows)."""

    def __init__(self) -> None:
        from . import stats as _stats

        self._v = _stats.rec()
        self._start = (self._v[_stats.THROTTLED], self._v[_stats.GETS])

    def throttled(self) -> int:
        from . import stats as _stats

        return int(_stats.rec()[_stats.THROTTLED] - self._start[0])

    def __str__(self) -> str:
        from . import stats as _stats

        v = _stats.rec()
        throttled = v[_stats.THROTTLED] - self._start[0]
        answered = throttled + v[_stats.GETS] - self._start[1]
        text = f"{v[_stats.INFLIGHT]:.0f} in flight"
        if throttled:
            text += f", {throttled:.0f} throttled ({throttled / answered:.0%})"
        if v[_stats.RATE_LIMIT]:
            text += f", store-throttled: {v[_stats.RATE_LIMIT]:.0f} GET/s allowed"
        return text

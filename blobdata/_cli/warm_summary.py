"""What a ``warm`` run did, and how the command line prints it."""

from __future__ import annotations

import dataclasses
from typing import Any, TextIO

from .._errors import CacheError
from .._url import printable

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "WarmSummary",
    "human_size",
    "print_summary",
    "used_bytes",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def human_size(n: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units, as ``parse_size`` reads them)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


@dataclasses.dataclass
class WarmSummary:
    """What one ``warm`` run did. Byte counts are bytes; ``seconds`` is wall time of the fetch phase."""

    url: str
    shard_objects: int = 0
    shard_bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    failed: int = 0
    not_admitted: int = 0
    not_admitted_bytes: int = 0
    cache_full: bool = False
    interrupted: bool = False
    aborted: bool = False
    denied: bool = False  # stopped at the first access-denied answer (refused credentials)
    seconds: float = 0.0
    failures: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    first_error: BaseException | None = None
    write_error: CacheError | None = None
    cache_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    fits: bool | None = None  # whether what is missing fits in the cache's free room
    throttled: int = 0  # requests the store answered with throttling (retried; the node slowed down)
    #: ``blobdata.warm(mixture)``: each source's own summary, by name (this one is their sum).
    sources: dict[str, WarmSummary] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_sources(cls, url: str, parts: dict[str, WarmSummary]) -> WarmSummary:
        """The sum of several sources' runs (one after the other: their seconds add up)."""
        out = cls(url=url, sources=dict(parts))
        for p in parts.values():
            for f in ("shard_objects", "shard_bytes", "skipped", "skipped_bytes", "fetched", "fetched_bytes",
                      "failed", "not_admitted", "not_admitted_bytes", "seconds", "throttled"):  # fmt: skip
                setattr(out, f, getattr(out, f) + getattr(p, f))
            for f in ("cache_full", "interrupted", "aborted", "denied"):
                setattr(out, f, getattr(out, f) or getattr(p, f))
            out.failures += p.failures
            out.first_error = out.first_error or p.first_error
            out.write_error = out.write_error or p.write_error
            out.cache_info = p.cache_info or out.cache_info
            out.fits = p.fits if out.fits is None else (out.fits and p.fits is not False)
        return out

    @property
    def mb_per_s(self) -> float:
        return self.fetched_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if self.failed or self.write_error else EXIT_OK


def used_bytes(info: dict[str, Any]) -> int:
    used = info.get("bytes", 0)
    return int(used) if isinstance(used, (int, float)) else 0


def print_summary(s: WarmSummary, *, rank: int, world_size: int, cache_dir: str, out: TextIO) -> None:
    if s.interrupted:  # Ctrl-C: one line; what was cut short is not a failure
        print(
            f"interrupted {printable(s.url)}: fetched {s.fetched} objects ({human_size(s.fetched_bytes)}) in "
            f"{s.seconds:.1f}s, {s.skipped} were cached already; run it again to fetch the rest",
            file=out,
            flush=True,
        )
        return
    head = "interrupted" if s.interrupted else ("stopped" if s.aborted else "warmed")
    shard = f"rank {rank} of {world_size}: " if world_size > 1 else ""
    lines = [
        f"{head} {printable(s.url)} ({shard}{s.shard_objects} objects, {human_size(s.shard_bytes)})",
        f"  fetched  {s.fetched} objects, {human_size(s.fetched_bytes)} in {s.seconds:.1f}s"
        f" = {s.mb_per_s:.1f} MB/s",
        f"  skipped  {s.skipped} objects already cached ({human_size(s.skipped_bytes)})",
        f"  failed   {s.failed} objects",
    ]
    if s.throttled:
        lines.insert(2, f"  throttled {s.throttled} requests: the store limits its request rate (retried)")
    for url, message in s.failures:  # keys come from the bucket or an index: escaped for the terminal
        lines.append(f"    {printable(url)}: {printable(message)}")
    if s.failed > len(s.failures):
        lines.append(f"    ... and {s.failed - len(s.failures)} more")
    if s.cache_full:
        lines.append(
            f"  cache full: {s.not_admitted} objects ({human_size(s.not_admitted_bytes)}) not admitted; "
            "raise --cache-size or use a larger disk"
        )
    info = s.cache_info
    if info:
        limit = info.get("limit")
        limit_text = f" of {human_size(limit)}" if isinstance(limit, int) else ""
        lines.append(
            f"  cache    {cache_dir}: {info.get('entries', '?')} entries, "
            f"{human_size(used_bytes(info))}{limit_text} ({info.get('policy', '?')})"
        )
    print("\n".join(lines), file=out, flush=True)

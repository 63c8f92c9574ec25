"""``blobdata ls URL`` for a folder read as a :class:`~blobdata.BlobDataset`: samples, objects, members.

The samples are made by :func:`blobdata._listing.build_table`, as ``BlobDataset(URL, ...)`` makes them:
from the folder's listing (samples by webdataset's key rule, or the rows of a metadata file found at the
root or named by ``--metadata``), or from ``--index FILE`` (CSV, JSONL, Parquet or an S3 Inventory
``manifest.json``, no listing; a bad row is an error naming the file and line).

``--save-manifest PATH`` saves what ``BlobDataset`` then loads without asking the store: the listing
(``BlobDataset(URL, manifest=PATH)``), or for an index the sample table it makes
(:mod:`blobdata._listing.tablefile`; ``BlobDataset(URL, index=PATH)`` loads it without parsing anything).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions
from .._errors import ConfigError
from .._listing import SampleTable, build_table, table_to_bytes
from .._url import parse_url, printable
from .layout import INDEX, Layout, memory_note
from .warm import human_size
from .warm_summary import EXIT_OK

__all__ = ["cmd_ls_samples"]


class _Saved:
    """A table as ``_save_manifest`` saves a manifest: ``save(path)`` (atomic) and ``to_bytes()``."""

    def __init__(self, table: SampleTable, source: str) -> None:
        self.table, self.source = table, source

    def save(self, path: str) -> None:
        from .._listing import save_table

        save_table(self.table, path, source=self.source)

    def to_bytes(self) -> bytes:
        return table_to_bytes(self.table, source=self.source)


def sample_table(
    args: argparse.Namespace, url: str, opts: dict[str, Any], layout: Layout, *, refresh: bool
) -> SampleTable:
    """The samples ``BlobDataset(url, index=, metadata=, manifest=)`` reads, as it makes them."""
    if args.manifest and layout.kind == INDEX:
        raise ConfigError("pass --index or --manifest, not both: an index names the objects, no listing")
    return build_table(
        url, storage_options=opts, metadata=args.metadata, index=args.index, manifest=args.manifest,
        refresh=refresh, max_age=DEFAULT_LISTING_MAX_AGE, share=False,
        fetch_options=FetchOptions(concurrency=args.concurrency),
    )  # fmt: skip


def members(table: SampleTable) -> dict[str, list[int]]:
    """member name -> [objects, bytes known], in order of first appearance."""
    out: dict[str, list[int]] = {}
    sizes = table.sizes.tolist()
    for j in range(table.num_objects):
        name = table.name(j).removesuffix("[]")
        row = out.setdefault(name, [0, 0])
        row[0] += 1
        row[1] += max(0, sizes[j])
    return out


def cmd_ls_samples(
    args: argparse.Namespace,
    url: str,
    opts: dict[str, Any],
    layout: Layout,
    started: float,
    save: Callable[[Any, str, dict[str, Any]], None],
) -> int:
    t0 = time.perf_counter()
    # The listing read to find the layout is fresh and remembered: not listed again for --refresh.
    table = sample_table(args, url, opts, layout, refresh=args.refresh and layout.listing is None)
    took = time.perf_counter() - t0
    known = table.sizes >= 0
    total, unknown = int(table.sizes[known].sum()), int((~known).sum())
    ids = table.arrays()["ids_off"]
    no_identity = int((ids[1:] == ids[:-1]).sum())
    by_member = members(table)
    fields = sorted(table.fields(0)) if len(table) else []
    memory = memory_note(table.listing, args.manifest, started)
    if args.save_manifest:
        remote = parse_url(args.save_manifest).protocol != "file"
        saved = _Saved(table, args.index) if layout.kind == INDEX else table.listing
        save(saved, args.save_manifest, opts if remote else {})
    if args.json:
        doc = {
            "root": url, "layout": layout.kind, "layout_reason": layout.why, "index": args.index,
            "metadata": layout.metadata, "samples": len(table), "objects": table.num_objects, "bytes": total,
            "members": [{"name": k, "objects": v[0], "bytes": v[1]} for k, v in by_member.items()],
            "fields": fields, "unknown_sizes": unknown, "unknown_identities": no_identity,
            "listed_at": table.listing.listed_at if table.listing is not None else None,
            "remembered": memory is not None, "seconds": round(took, 3), "saved": args.save_manifest,
        }  # fmt: skip
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return EXIT_OK
    print(printable(layout.line()))
    if layout.kind == INDEX:
        how = f"from index {printable(args.index)} in {took:.1f}s"
    else:
        how = memory if memory is not None else "listed now"
    print(f"{printable(url)}: {len(table)} samples, {table.num_objects} objects, {human_size(total)} ({how})")
    names = [printable(k) for k in by_member]
    width = max([len("member"), *(len(n) for n in names)])
    print(f"{'member':<{width}}  {'objects':>10}  {'bytes':>12}")
    for name, (n, b) in zip(names, by_member.values(), strict=True):
        print(f"{name:<{width}}  {n:>10}  {human_size(b):>12}")
    if fields:
        print(f"fields: {printable(', '.join(fields))}")
    if unknown or no_identity:
        print(f"{unknown} sizes and {no_identity} ETags not in the index: learned at each object's 1st read")
    if args.save_manifest:
        target = printable(args.save_manifest)
        if layout.kind == INDEX:
            print(f"saved the samples to {target} (pass it as index= / --index: loaded without parsing the "
                  "index again)")  # fmt: skip
        else:
            print(f"saved the listing to {target} (pass it as manifest= / --manifest on other nodes)")
    return EXIT_OK

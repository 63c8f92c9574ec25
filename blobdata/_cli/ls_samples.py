"""``blobdata ls URL --index FILE [--save-manifest PATH]``: an index's samples, and the index converted once.

The index (CSV, JSONL, Parquet or an S3 Inventory ``manifest.json``) is parsed as
``BlobDataset(URL, index=FILE)`` parses it (a bad row is an error naming the file and line), and the
sample table it makes is saved (:mod:`blobdata._listing.tablefile`): ``BlobDataset(URL, index=PATH)``
then loads it without parsing anything, and without a LIST request.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from .._config import FetchOptions
from .._errors import ConfigError
from .._listing import SampleTable, build_table, table_to_bytes
from .._stores import resolve_storage_options
from .._url import parse_url, printable
from .warm import human_size
from .warm_summary import EXIT_OK

__all__ = ["cmd_ls_index"]


class _Saved:
    """A table as ``_save_manifest`` saves a manifest: ``save(path)`` (atomic) and ``to_bytes()``."""

    def __init__(self, table: SampleTable, source: str) -> None:
        self.table, self.source = table, source

    def save(self, path: str) -> None:
        from .._listing import save_table

        save_table(self.table, path, source=self.source)

    def to_bytes(self) -> bytes:
        return table_to_bytes(self.table, source=self.source)


def cmd_ls_index(
    args: argparse.Namespace, options: dict[str, Any], save: Callable[[Any, str, dict[str, Any]], None]
) -> int:
    if args.manifest:
        raise ConfigError("pass --index or --manifest, not both: an index names the objects, no listing")
    url = str(parse_url(args.url))
    opts = resolve_storage_options(parse_url(url).protocol, options)
    started = time.perf_counter()
    table = build_table(
        url, storage_options=opts, metadata=None, index=args.index, manifest=None, refresh=False,
        max_age=None, fetch_options=FetchOptions(), share=False,
    )  # fmt: skip
    took = time.perf_counter() - started
    known = table.sizes >= 0
    total, unknown = int(table.sizes[known].sum()), int((~known).sum())
    no_identity = int((table.arrays()["ids_off"][1:] == table.arrays()["ids_off"][:-1]).sum())
    if args.save_manifest:
        remote = parse_url(args.save_manifest).protocol != "file"
        save(_Saved(table, args.index), args.save_manifest, opts if remote else {})
    if args.json:
        doc = {
            "root": url, "index": args.index, "samples": len(table), "objects": table.num_objects,
            "bytes": total, "unknown_sizes": unknown, "unknown_identities": no_identity,
            "seconds": round(took, 3), "saved": args.save_manifest,
        }  # fmt: skip
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return EXIT_OK
    print(f"{printable(url)}: {len(table)} samples, {table.num_objects} objects, {human_size(total)} "
          f"from index {printable(args.index)} in {took:.1f}s")  # fmt: skip
    if unknown or no_identity:
        print(f"{unknown} sizes and {no_identity} ETags not in the index: learned at each object's 1st read")
    if args.save_manifest:
        print(f"saved the samples to {printable(args.save_manifest)} (pass it as index= / --index: "
              "loaded without parsing the index again)")  # fmt: skip
    return EXIT_OK

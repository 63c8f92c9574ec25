"""An index parsed at every construction vs the same index converted once (``blobdata ls URL --index FILE
--save-manifest PATH``) and loaded: seconds to the sample table of ``BlobDataset(URL, index=...)``.

    python benchmarks/bench_index_saved.py                 # 1,000,000 rows (500,000 pairs), CSV and Parquet
    python benchmarks/bench_index_saved.py --rows 200000   # a quick run

No server: the table is all that is built (``blobdata._listing.build_table``, which the dataset calls), so
the numbers are the construction cost alone. Rows are ``NNNNNNN.jpg`` + ``NNNNNNN.txt`` with a size, a
label field on the jpg row. The saved table is loaded twice: first on this node (its CRC-32 computed),
then again (the node's verified-marker skips it, as every other process of the node does). Each figure is
the median of ``--rounds``. A benchmark, not a test: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="index rows (default 1000000)")
    p.add_argument("--rounds", type=int, default=3, help="repetitions, median shown (default 3)")
    args = p.parse_args(argv)

    from blobdata._config import FetchOptions
    from blobdata._listing import build_table, save_table

    root = "s3://bench/pairs"

    def build(index: Path) -> object:
        return build_table(
            root, storage_options={}, metadata=None, index=str(index), manifest=None, refresh=False,
            max_age=None, fetch_options=FetchOptions(), share=False,
        )  # fmt: skip

    def timed(fn: object, *a: object) -> float:
        t = time.perf_counter()
        fn(*a)  # type: ignore[operator]
        return time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "index.csv"
        with csv.open("w") as fh:
            fh.write("key,size,label\n")
            for i in range(args.rows // 2):
                fh.write(f"{i:07d}.jpg,{1000 + i % 977},{i % 1000}\n{i:07d}.txt,{20 + i % 7},\n")
        sources = {"CSV": csv}
        try:
            import pyarrow.csv as pacsv
            import pyarrow.parquet as pq

            parquet = Path(tmp) / "index.parquet"
            pq.write_table(pacsv.read_csv(csv), parquet)
            sources["Parquet"] = parquet
        except ImportError:
            pass
        print(f"{'index':<10}{'rows':>10}{'parse (s)':>11}{'save (s)':>10}{'load 1st (s)':>14}"
              f"{'load (s)':>10}{'parse/load':>12}{'file MB':>9}")  # fmt: skip
        for name, src in sources.items():
            parse, first, again = [], [], []
            saved = Path(tmp) / f"{name}.samples"
            table = build(src)
            save_s = timed(save_table, table, saved)
            del table
            for r in range(args.rounds):
                parse.append(timed(build, src))
                copy = Path(tmp) / f"{name}.{r}.samples"  # a new file: not verified on this node yet
                copy.write_bytes(saved.read_bytes())
                first.append(timed(build, copy))
                again.append(timed(build, copy))
            mp, mf, ma = (statistics.median(x) for x in (parse, first, again))
            print(f"{name:<10}{args.rows:>10}{mp:>11.2f}{save_s:>10.2f}{mf:>14.3f}{ma:>10.3f}"
                  f"{mp / ma:>11.0f}x{saved.stat().st_size / 1e6:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""What the loader's live statistics cost: per-sample CPU with stats against a checkout without them.

Two measurements, side by side:

1. **Pipeline CPU per sample.** A local folder of synthetic JPEGs (``blobdata._cli.demo.synthetic_dataset``,
   60-150 KB) read through ``FolderDataset(..., transform=TrainTransform()).dataloader(batch_size=32,
   num_workers=0)``: every stage (fetch from local files, decode, crop, collate, the look-ahead on the
   background loop) runs in one process, so ``time.process_time()`` of that process is the whole cost.
   Each variant runs in its own child process (``PYTHONPATH`` = this checkout, or ``--baseline DIR``, a
   checkout without stats, e.g. ``git archive <commit> | tar -x -C DIR``), one untimed epoch then
   ``--repeat`` timed ones, alternating the variants ``--rounds`` times; the best epoch of each is kept.
2. **The hooks alone.** The counter updates one sample causes (one GET, one decode, one transform, a
   32nd of a batch's updates), timed in a tight loop in this process: the part of (1) stats add.

    python benchmarks/bench_stats.py --baseline /tmp/blobdata-base [--images 300] [--repeat 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys, time
from blobdata import FolderDataset
from blobdata.testing import TrainTransform
folder, repeat = sys.argv[1], int(sys.argv[2])
ds = FolderDataset(folder, transform=TrainTransform())
loader = ds.dataloader(batch_size=32, shuffle=True, num_workers=0)
n = sum(len(t) for _, t in loader)  # untimed: file cache, imports, loop start
best = float("inf")
for _ in range(repeat):
    c0 = time.process_time()
    n = sum(len(t) for _, t in loader)
    best = min(best, (time.process_time() - c0) / n)
print(json.dumps({"cpu_per_sample_s": best, "samples": n, "has_stats": hasattr(loader, "stats")}))
"""


def _child(pythonpath: str, folder: str, repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, folder, str(repeat)],
        env=env, cwd=folder, capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    return dict(json.loads(out.strip().splitlines()[-1]))


def _hooks_per_sample(batch: int = 32, loops: int = 20000) -> float:
    """Seconds of counter updates per sample: what __getitems__, _gather, _load, the engine, the
    collate wrapper and the loop's iterator add, replayed with the real functions."""
    sys.path.insert(0, str(REPO))
    from blobdata._metrics import stats as s

    pc = time.perf_counter
    per_sample = 1.0 / batch

    def one_sample() -> None:
        v = s.rec()  # _load: cache miss path
        v[s.FROM_BUCKET] += 1
        t = pc()  # engine: one GET
        s.note_get(pc() - t, 100_000)
        t = pc()  # __getitems__: decode, transform
        t2 = pc()
        dec = t2 - t
        tr = pc() - t2
        v[s.DECODE_S] += dec * per_sample  # the per-batch updates, a share of them
        v[s.TRANSFORM_S] += tr * per_sample

    def batch_share() -> None:
        v = s.rec()
        t = pc()
        v[s.FETCH_WAIT_S] += pc() - t
        v[s.SERVED] += batch
        v[s.BATCHES] += 1
        v[s.STAGED] += 0
        t = pc()  # collate wrapper and the loop's iterator
        v[s.COLLATE_S] += pc() - t
        t = pc()
        _ = pc() - t

    c0 = time.perf_counter()
    for _ in range(loops):
        one_sample()
    c1 = time.perf_counter()
    for _ in range(loops // batch):
        batch_share()
    c2 = time.perf_counter()
    return (c1 - c0) / loops + (c2 - c1) / loops


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="a checkout without stats (PYTHONPATH of the 'off' variant)")
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    from blobdata.testing import synthetic_dataset

    hooks = _hooks_per_sample()
    print(f"counter updates per sample (hooks alone): {hooks * 1e6:.2f} us")
    if not args.baseline:
        print("no --baseline: pipeline comparison skipped")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for key, data in synthetic_dataset(args.images, 10, prefix="train"):
            path = Path(tmp, key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        folder = str(Path(tmp, "train"))
        best = {"on": float("inf"), "off": float("inf")}
        for r in range(args.rounds):
            for name, path in (("on", str(REPO)), ("off", args.baseline)):
                got = _child(path, folder, args.repeat)
                if bool(got["has_stats"]) != (name == "on"):
                    raise SystemExit(f"--baseline must be a checkout without stats ({name}: {got})")
                best[name] = min(best[name], got["cpu_per_sample_s"])
                print(f"round {r + 1} stats {name:>3}: {got['cpu_per_sample_s'] * 1e3:.3f} ms CPU per sample")
    on, off = best["on"], best["off"]
    print(f"\nbest of each: stats on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms per sample: "
          f"on/off = {on / off:.4f} ({(on - off) / off:+.2%})")  # fmt: skip
    print(f"hooks alone: {hooks * 1e6:.2f} us per sample = {hooks / off:.3%} of the pipeline's CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Draw the documentation's performance figures from the tables in docs/performance/ (no numbers here).

    python benchmarks/plot_docs.py      # writes docs/performance/epoch.svg and partition.svg

Each figure reads the Markdown table it shows, so a table updated from a new run and its figure
cannot disagree once this is run again. Needs matplotlib (the ``plot`` or ``test`` extra).
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

matplotlib.rcParams["svg.hashsalt"] = "blobdata"  # the same SVG for the same table: diffs stay clean

DOCS = Path(__file__).resolve().parents[1] / "docs" / "performance"


def table(page: Path, header_start: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table whose header starts with ``header_start``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float:
    return float(re.sub(r"[^\d.]", "", cell.split(",")[0]) or "nan")


def epoch_figure() -> Path:
    rows = table(DOCS / "index.md", "| system | RTT 0")
    names = [re.sub(r"`|\(.*?\)", "", r[0]).strip() for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [number(r[1]) for r in rows], height=0.4, label="RTT 0")
    ax.barh([i - 0.2 for i in y], [number(r[3]) for r in rows], height=0.4, label="RTT 50 ms")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("images/s, one training epoch (2 shared cores)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    out = DOCS / "epoch.svg"
    fig.savefig(out, metadata={"Date": None})
    return out


def partition_figure() -> Path:
    rows = table(DOCS / "partition.md", "| nodes | cache per node")
    fig, ax = plt.subplots(figsize=(8, 3.4))
    epochs = range(1, 6)
    for k, (_nodes, cache, dist, part) in enumerate(r for r in rows if r[0] == "16"):
        d = [number(v) for v in dist.split(",")[:5]]
        p = [number(v) for v in re.sub(r"\(.*", "", part).split(",")[:5]]
        color = f"C{k}"
        ax.plot(epochs, d, marker="o", color=color, label=f"DistributedSampler, cache {cache} of the data")
        ax.plot(epochs, p, marker="s", color=color, ls="--", label=f"PartitionedSampler, cache {cache}")
    ax.set_xticks(list(epochs))
    ax.set_xlabel("epoch")
    ax.set_ylabel("bucket reads, % of the dataset")
    ax.set_title("16 nodes", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    out = DOCS / "partition.svg"
    fig.savefig(out, metadata={"Date": None})
    return out


if __name__ == "__main__":
    for path in (epoch_figure(), partition_figure()):
        print(f"wrote {path}")

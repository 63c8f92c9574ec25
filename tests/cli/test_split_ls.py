"""``blobdata ls --split-listing --nnodes 2 --node-rank R`` on two "nodes" at once (two processes sharing
BLOBDATA_SHARED_DIR): each lists a part of the synthetic bucket, no page is asked twice, and both print
the listing one process prints alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from blobdata._cli.main import main
from blobdata.testing import SyntheticListServer

ROOT = Path(__file__).resolve().parents[2]


def test_two_nodes_list_together_and_print_the_same_listing(tmp_path: Path, capsys: object) -> None:
    with SyntheticListServer(count=24_000, classes=2, delay_s=0.03) as server:
        opts = [
            "-o",
            f"endpoint_url={server.endpoint_url}",
            "-o",
            "key=synthetic",
            "-o",
            "secret=synthetic-secret",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "BLOBDATA_SHARED_DIR": str(tmp_path / "shared"),
            "BLOBDATA_CACHE_HOME": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1",
        }
        nodes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "blobdata",
                    "ls",
                    server.url,
                    *opts,
                    "--json",
                    "--refresh",
                    "--concurrency",
                    "4",
                    "--split-listing",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(r),
                ],
                env={**env, "BLOBDATA_CACHE_HOME": str(tmp_path / f"cache{r}")},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for r in range(2)
        ]
        outs = [n.communicate(timeout=240) for n in nodes]
        assert all(n.returncode == 0 for n in nodes), [o[1].decode()[-2000:] for o in outs]
        together = list(server.asked)
        del server.asked[:]
        assert main(["ls", server.url, *opts, "--json", "--refresh", "--concurrency", "4"]) == 0
    docs = [json.loads(out) for out, _ in outs]
    alone = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    for doc in docs:
        assert doc["objects"] == alone["objects"] == 24_000 and doc["classes"] == alone["classes"]
    assert len(set(together)) == len(together)  # no page asked twice by the two nodes

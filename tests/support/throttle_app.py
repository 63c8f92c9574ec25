"""A loader in a process of its own, for the throttle tests: ``python -m tests.support.throttle_app``.

    python -m tests.support.throttle_app URL OPTIONS_JSON epoch   # one epoch (num_workers=0); prints
                                                                  # {"pid", "digest", "samples", "seconds"}
    python -m tests.support.throttle_app URL OPTIONS_JSON epoch GO  # the same, once the file GO exists:
                                                                  # prints {"ready": pid} and waits for it
    python -m tests.support.throttle_app URL OPTIONS_JSON hold    # one batch, prints {"pid", "channel"},
                                                                  # then waits to be killed

``digest`` is the sha256 of every sample's bytes in the listing's order, so the test compares it
with the objects it uploaded. Storage options come as JSON (test credentials only).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def raw(fh: Any) -> bytes:
    return bytes(fh.read())


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def main(argv: list[str]) -> int:
    from blobdata import FolderDataset

    url, options, mode = argv[0], json.loads(argv[1]), argv[2]
    ds = FolderDataset(url, loader=raw, extensions=(".bin",), storage_options=options, share_listing=False)
    loader = ds.dataloader(batch_size=16, shuffle=False, num_workers=0, collate_fn=as_list)
    if mode == "hold":
        next(iter(loader))
        print(json.dumps({"pid": os.getpid(), "channel": loader.channel.path}), flush=True)
        while True:
            time.sleep(1)
    if len(argv) > 3:  # several apps begin their epochs together (the test says go once all are ready)
        print(json.dumps({"ready": os.getpid()}), flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(argv[3]):
            if time.monotonic() > deadline:
                print(f"throttle_app: {argv[3]} never came", file=sys.stderr)
                return 1
            time.sleep(0.01)
    t0 = time.monotonic()
    digest = hashlib.sha256()
    samples = 0
    for batch in loader:
        for data, _ in batch:
            digest.update(data)
            samples += 1
    seconds = time.monotonic() - t0
    print(
        json.dumps({"pid": os.getpid(), "digest": digest.hexdigest(), "samples": samples, "seconds": seconds})
    )
    ds.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

from __future__ import annotations
import os, time
import pytest
from blobdata._config import FetchOptions
from blobdata._fetch import FetchEngine
from blobdata.testing import HostileServer, HOSTILE_MODES

MODES = ["wrong_range", "no_etag", "range_ignored", "huge_length", "endless_chunked", "endless_body", "gzip_chunked", "lf_only", "long_header", "bare_cr"]

def _go(engine, url, size, ident):
    t = time.monotonic()
    out = engine.fetch_many_sync([(url, size, ident)])[0]
    return out, time.monotonic() - t

def test_gcs_explore() -> None:
    with HostileServer() as store:
        data = os.urandom(200_000)
        store.put("data", "a.bin", data)
        gen = str(store.generation("data", "a.bin"))
        opts = {"endpoint_url": store.endpoint_url, "token": "anon"}
        for mode in MODES:
            store.mode = None
            store.put("data", "a.bin", data); gen = str(store.generation("data", "a.bin"))
            if mode == "no_etag":
                store.put("data", "a.bin", os.urandom(200_000))
            store.mode = mode
            store.bytes_sent = 0
            eng = FetchEngine(FetchOptions(attempts=1, timeout=3, part_size=64*1024), "gs", opts)
            out, dt = _go(eng, "gs://data/a.bin", 200_000 if mode != "gzip_chunked" else None, gen)
            eng.close()
            desc = ("OK-same" if out == data else f"BYTES-WRONG len={len(out)}") if isinstance(out, bytes) else f"{type(out).__name__}: {str(out)[:150]}"
            print(f"GCS {mode}: {dt:.2f}s sent={store.bytes_sent} {desc}")


def test_az_explore(az_bucket) -> None:
    data = os.urandom(200_000)
    az_bucket.put("a.bin", data)
    conn = az_bucket.storage_options["connection_string"]
    import re
    up = re.search(r"BlobEndpoint=(http://[^/;]+)", conn).group(1)
    with HostileServer(upstream=up) as proxy:
        opts = {"connection_string": conn.replace(up, proxy.endpoint_url)}
        from blobdata._stores.azure import AzureReader
        import asyncio
        async def etag():
            r = AzureReader(az_bucket.storage_options)
            res = await r.read(az_bucket.name, "a.bin")
            await r.close()
            return res.identity
        from blobdata._loop import run
        ident = run(etag(), 30)
        for mode in MODES:
            az_bucket.put("a.bin", data)
            ident = run(etag(), 30)
            if mode == "no_etag":
                az_bucket.put("a.bin", os.urandom(200_000))
            proxy.mode = mode
            proxy.bytes_sent = 0
            eng = FetchEngine(FetchOptions(attempts=1, timeout=3, part_size=64*1024), "az", opts)
            out, dt = _go(eng, f"az://{az_bucket.name}/a.bin", 200_000 if mode != "gzip_chunked" else None, ident)
            eng.close()
            desc = ("OK-same" if out == data else f"BYTES-WRONG len={len(out)}") if isinstance(out, bytes) else f"{type(out).__name__}: {str(out)[:150]}"
            print(f"AZ {mode}: {dt:.2f}s sent={proxy.bytes_sent} {desc}")

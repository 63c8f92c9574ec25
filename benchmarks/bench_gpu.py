"""Does the GPU wait? ResNet-50 trained for one epoch per input path, against the synthetic-data ceiling.

    python benchmarks/bench_gpu.py                                   # on a CUDA machine
    python benchmarks/bench_gpu.py --client-cpus 0-11 --server-cpus 12-15 --workers 10
    python benchmarks/bench_gpu.py --dry-run                         # every row, tiny, on the CPU

Generates the synthetic ImageNet-like JPEG folder (once, under bench-data/), starts a local S3 server
(SeaweedFS) and a latency proxy (``--rtt``, default 50 ms) pinned to ``--server-cpus``, uploads the
folder, then trains torchvision's ResNet-50 (bf16 autocast, channels_last, SGD, batch 256) for one
epoch per row, each input path in its own child process pinned to ``--client-cpus``:

- ``synthetic``        random batches already on the GPU: the ceiling
- ``local, CPU``       a plain map-style Dataset on the local folder: Pillow decode, random-resized
                       crop 224, flip, uint8 tensor per sample in the workers (the usual pipeline)
- ``blobdata CPU cold/warm``  FolderDataset on the bucket with a fresh cache, the same per-sample work;
                       cold is the first epoch (from the bucket), warm the second (from the cache)
- ``blobdata CPU ..., cheaper crop``  the same, with ``blobdata.transforms.RandomResizedCrop`` as the
                       per-sample work (reduced-scale decode, torch's resize of the crop only)
- ``blobdata GPU cold/warm``  the same bucket with ``device="cuda", gpu_transform=gpu.TrainTransform``:
                       workers fetch bytes, the training process decodes and augments whole batches

Printed per row: images/s, x the ceiling, the share of the epoch the loop waited in ``next()``, time to
first batch, the training process's CPU per image (its threads, not the workers': on the GPU rows the
decode thread shares the loop's GIL, and this shows how much it adds), the GPU memory the input
pipeline added to the ceiling row's peak, and the cache's hit rate in that epoch. ``--save`` writes
the rows as JSON. ``--dry-run`` runs every row on the CPU with a tiny model, 32 px crops and a few
hundred images (the test suite runs it); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BENCH_DATA, IMAGE_PREFIX, fmt, parse_cpus, pin_tree, place_cpus, prepare_dataset, table

BUCKET = "bench"
ROWS = ["synthetic", "local-cpu", "blobdata-cpu", "blobdata-crop", "blobdata-gpu"]
NAMES = {
    "synthetic": ["synthetic (ceiling)"],
    "local-cpu": ["local, CPU decode"],
    "blobdata-cpu": ["blobdata CPU cold", "blobdata CPU warm"],
    "blobdata-crop": ["blobdata CPU cold, cheaper crop", "blobdata CPU warm, cheaper crop"],
    "blobdata-gpu": ["blobdata GPU cold", "blobdata GPU warm"],
}
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


# -- child side: one input path, timed ---------------------------------------------------------------


def read_bytes(file: Any) -> bytes:
    """blobdata's loader for the CPU rows: the object's bytes (the transform decodes them)."""
    return bytes(file.read())


class LocalFolder:
    """The usual map-style Dataset on local disk: read, then the per-sample work."""

    def __init__(self, root: str, keys: list[str], classes: list[str], work: Any) -> None:
        self.paths = [os.path.join(root, k) for k in keys]
        self.targets = [classes.index(k.rsplit("/", 2)[-2]) for k in keys]
        self.work = work

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        with open(self.paths[i], "rb") as f:
            return self.work(f.read()), self.targets[i]


def _model(spec: dict[str, Any], device: Any) -> Any:
    import torch

    if spec["dry_run"]:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, spec["classes"]),
        )
    else:
        import torchvision

        model = torchvision.models.resnet50(num_classes=spec["classes"])
    return model.to(device, memory_format=torch.channels_last)


def _epoch(spec: dict[str, Any], model: Any, batches: Any, device: Any, prepare: Any) -> dict[str, Any]:
    """Train one epoch over ``batches``; (images, seconds, wait share, first batch s, peak GPU bytes)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, cpu0 = time.perf_counter(), time.process_time()
    it = iter(batches)
    waited, images, first = 0.0, 0, None
    while True:
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            break
        now = time.perf_counter()
        waited += now - t
        if first is None:
            first = now - t0
        x, y = prepare(x, y)
        with autocast:
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        images += int(y.shape[0])
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        # CPU of the training process's threads (not the workers'): the loop, and on the GPU rows the
        # decode thread beside it, which shares its GIL.
        "trainer_cpu_ms": (time.process_time() - cpu0) * 1e3 / images if images else 0.0,
        "images": images,
        "seconds": seconds,
        "wait": waited / seconds if seconds else 0.0,
        "first_batch_s": first or 0.0,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
    }


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec["client_cpus"]:
        os.sched_setaffinity(0, spec["client_cpus"])
    import torch

    from blobdata import BlobCache, FolderDataset, gpu
    from blobdata.transforms import RandomResizedCrop

    device = torch.device("cpu" if spec["dry_run"] else "cuda")
    torch.backends.cudnn.benchmark = True  # every row alike: the fastest convolutions for this shape
    size, batch, workers, n = spec["size"], spec["batch_size"], spec["workers"], len(spec["keys"])
    model = _model(spec, device)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def from_uint8(x: Any, y: Any) -> tuple[Any, Any]:  # the CPU rows: normalise on the device
        x = x.to(device, non_blocking=True).float().sub_(mean).div_(std)
        return x.contiguous(memory_format=torch.channels_last), y.to(device, non_blocking=True)

    def as_is(x: Any, y: Any) -> tuple[Any, Any]:
        return x, y

    row, results = spec["row"], []
    pin = not spec["dry_run"]
    loader_args = {"batch_size": batch, "shuffle": True, "num_workers": workers, "pin_memory": pin}
    if row == "synthetic":
        x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, spec["classes"], (batch,), device=device)
        results.append(_epoch(spec, model, [(x, y)] * max(1, n // batch), device, as_is))
    elif row == "local-cpu":
        ds = LocalFolder(spec["local_root"], spec["keys"], spec["classes_names"], _Work(size))
        loader = torch.utils.data.DataLoader(ds, **loader_args)
        results.append(_epoch(spec, model, loader, device, from_uint8))
    else:
        os.environ["BLOBDATA_CACHE_HOME"] = os.path.join(spec["scratch"], "home")
        cache = BlobCache(os.path.join(spec["scratch"], "cache"), size_limit="100GB")
        options = spec["storage_options"]
        url = f"s3://{BUCKET}/{IMAGE_PREFIX}"
        if row in ("blobdata-cpu", "blobdata-crop"):
            # RandomResizedCrop is decode-aware: the dataset hands it the bytes, as read_bytes does.
            work = {"loader": read_bytes, "transform": _Work(size)} if row == "blobdata-cpu" else {
                "transform": RandomResizedCrop(size)}  # fmt: skip
            fds = FolderDataset(url, storage_options=options, cache=cache, **work)
            loader = fds.dataloader(**loader_args)
            prepare = from_uint8
        else:
            fds = FolderDataset(url, storage_options=options, cache=cache)
            dtype = torch.float32 if spec["dry_run"] else torch.bfloat16
            loader = fds.dataloader(
                **{**loader_args, "pin_memory": False},
                device=device,
                gpu_transform=gpu.TrainTransform(size, mean=MEAN, std=STD, dtype=dtype),
            )
            prepare = as_is
        if len(fds) != n:
            raise RuntimeError(f"blobdata listed {len(fds)} samples, expected {n}")
        for _ in ("cold", "warm"):  # cold fills the cache, warm reads it
            before = loader.stats()
            results.append(_epoch(spec, model, loader, device, prepare))
            fds.close()  # flushes this process's cache writes; the workers flushed theirs at exit
            after = loader.stats()
            reads = (after.samples_from_cache + after.samples_from_bucket) - (
                before.samples_from_cache + before.samples_from_bucket
            )
            hits = after.samples_from_cache - before.samples_from_cache
            results[-1]["hit_rate"] = hits / reads if reads else 0.0
    Path(spec["out"]).write_text(json.dumps(results))
    return 0


class _Work:
    """bytes -> uint8 CHW tensor: Pillow decode, random-resized crop, flip (picklable for spawn)."""

    def __init__(self, size: int) -> None:
        from blobdata.testing import TrainTransform

        self.transform = TrainTransform(size)

    def __call__(self, data: bytes) -> Any:
        import io

        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            return self.transform(img.convert("RGB"))


# -- parent side ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--images", type=int, default=12800)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--rtt", type=float, default=50.0, help="round-trip time added by the proxy, ms")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=10, help="DataLoader workers (default 10)")
    p.add_argument("--size", type=int, default=224, help="crop size (default 224)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    p.add_argument("--client-cpus", help="CPUs of the trainer and its workers, e.g. 0-11")
    p.add_argument("--server-cpus", help="CPUs of the S3 server and the proxy, e.g. 12-15")
    p.add_argument("--save", help="write the rows as JSON to this file")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per row's child (default 1800)")
    p.add_argument("--dry-run", action="store_true", help="every row tiny, on the CPU, with a tiny model")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.images, args.classes, args.batch_size, args.size = min(args.images, 192), 4, 32, 32
        args.workers = min(args.workers, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if set(rows) - set(ROWS):
        print(f"unknown rows {sorted(set(rows) - set(ROWS))}; choose from {ROWS}", file=sys.stderr)
        return 2
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
    client, server_cpus, placement = place_cpus(parse_cpus(args.client_cpus), parse_cpus(args.server_cpus))
    print(placement, flush=True)
    if server_cpus:
        os.sched_setaffinity(0, server_cpus)  # this process runs the proxy's thread

    from bench_latency import _s3_client, settle_server

    from blobdata.testing import LatencyProxy, LocalS3Server, upload

    data = prepare_dataset(args.images, args.classes, log=lambda m: print(m, flush=True))
    BENCH_DATA.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=BENCH_DATA))
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LocalS3Server(backend="moto" if args.dry_run else "seaweedfs"))
        if server_cpus:
            pin_tree(server.pid, server_cpus)
        s3 = _s3_client(server.endpoint_url, server)
        s3.create_bucket(Bucket=BUCKET)
        upload(s3, BUCKET, ((k, (data.root / k).read_bytes()) for k in data.keys))
        if not args.dry_run:
            settle_server(s3, data.keys)
        host, port = server.endpoint_url.rsplit("/", 1)[-1].rsplit(":", 1)
        endpoint = server.endpoint_url
        if args.rtt > 0:
            proxy = stack.enter_context(LatencyProxy(host, int(port), delay_s=args.rtt / 2000))
            endpoint = proxy.endpoint_url
        options = {**server.storage_options, "endpoint_url": endpoint}
        for row in rows:
            scratch = work / row
            scratch.mkdir()
            spec = {
                "row": row, "dry_run": args.dry_run, "keys": data.keys, "classes": len(data.classes),
                "classes_names": data.classes, "local_root": str(data.root), "size": args.size,
                "batch_size": args.batch_size, "workers": args.workers, "storage_options": options,
                "scratch": str(scratch), "client_cpus": sorted(client) if client else None,
                "out": str(scratch / "out.json"),
            }  # fmt: skip
            (scratch / "spec.json").write_text(json.dumps(spec))
            print(f"{row} ...", end=" ", flush=True)
            command = [sys.executable, __file__, "--child", str(scratch / "spec.json")]
            proc = subprocess.run(command, timeout=args.timeout, check=False)
            if proc.returncode != 0:
                print(f"failed (exit {proc.returncode})", flush=True)
                continue
            for name, r in zip(NAMES[row], json.loads((scratch / "out.json").read_text()), strict=True):
                rate = r["images"] / r["seconds"] if r["seconds"] else 0.0
                results.append({"row": name, **r, "rate": rate})
            print("done", flush=True)
    print_results(results, args, placement, time.perf_counter() - started)
    if args.save:
        Path(args.save).write_text(json.dumps({"placement": placement, "rows": results}, indent=1))
    return 0 if len(results) == sum(len(NAMES[r]) for r in rows) else 1


def print_results(
    results: list[dict[str, Any]], args: argparse.Namespace, placement: str, elapsed: float
) -> None:
    ceiling = next((r for r in results if r["row"].startswith("synthetic")), None)
    base_rate = ceiling["rate"] if ceiling else None
    base_peak = ceiling["peak_bytes"] if ceiling else 0
    local = next((r for r in results if r["row"].startswith("local")), None)
    cells = []
    for r in results:
        cells.append([
            r["row"], fmt(r["rate"]), fmt(r["rate"] / base_rate if base_rate else None, ".2f"),
            fmt(r["rate"] / local["rate"] if local else None, ".2f"), fmt(100 * r["wait"], ".0f") + "%",
            fmt(r["first_batch_s"], ".2f"), fmt(r["trainer_cpu_ms"], ".2f"),
            fmt(max(0, r["peak_bytes"] - base_peak) / 2**20, ".0f"),
            fmt(100 * r["hit_rate"], ".0f") + "%" if "hit_rate" in r else "-",
        ])  # fmt: skip
    what = "dry run on the CPU (numbers mean nothing)" if args.dry_run else "ResNet-50, bf16 autocast"
    print(f"\n===== {what}: {args.images} images, batch {args.batch_size}, {args.workers} workers, "
          f"RTT {args.rtt:g} ms; {placement}; {elapsed:.0f}s =====")  # fmt: skip
    headers = ["input", "images/s", "x ceiling", "x local", "loop waited", "1st batch s",
               "trainer CPU ms/img", "pipeline GPU MiB", "hit rate"]  # fmt: skip
    print(table(headers, cells))
    print("goal (issue 15): GPU cold >= 0.85x and warm >= 0.90x the ceiling, both >= 1.5x local CPU decode")


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the GPU wait? The GPU path measured in one run, stage by stage, each stage's result saved at once.

    python benchmarks/bench_gpu.py --out DIR                 # on a CUDA machine (gpu_node.sh runs it)
    python benchmarks/bench_gpu.py --out DIR --smoke         # every stage, tiny, on the CPU

Writes ``DIR/gpu_node.json`` after every stage (a run cut short keeps what it measured), in order:

1. ``versions``: Python, torch, CUDA, the GPU and its driver, nvImageCodec, torchvision, the nvJPEG
   library actually loaded, and the hardware-decoder check (baseline JPEGs through nvImageCodec's
   hardware backend alone; ``nvidia-smi dmon``'s JPEG-engine utilisation while decoding).
2. ``images``: the realistic mix of gpu_images.py (progressive, grayscale, CMYK, EXIF-rotated, 4:4:4,
   1-4 MP photos...) generated in parallel on every core.
3. ``decode``: decode-only images/s, the training process's CPU ms per image and the refusals, for
   nvImageCodec's hardware decoder alone, blobdata's choice (hardware then CUDA), nvImageCodec's
   defaults and torchvision; with the GPU idle, then with ResNet-50 training beside it (another
   process). Plus the transform alone.
4. ``synthetic``: ResNet-50 (bf16 autocast, channels-last, SGD) on random batches already on the GPU,
   after an untimed warm-up (cuDNN's autotuning), over ``--steps`` timed steps: the ceiling.
5. ``in_memory``: the same model fed by the device pipeline from raw batches held in memory (no
   bucket, no workers): what decode + augmentation on the GPU can feed.
6. ``local_cpu``: fed by a plain DataLoader over the local folder (Pillow decode, random-resized
   crop and flip in ``--workers`` workers): the usual pipeline.
7. ``bucket_cold`` / ``bucket_warm``: fed by ``FolderDataset(...).dataloader(device="cuda",
   gpu_transform=gpu.TrainTransform(224))`` from a local S3 server behind a ``--rtt`` ms proxy, with a
   fresh cache (cold: from the bucket), then again (warm: from the cache).

Each training row gives images/s, its ratio to the ceiling and to local CPU decode, the share of the
time the loop waited for a batch, and the training process's CPU ms per image. Stages that would not
fit the ``--budget`` seconds left are recorded as skipped. ``--smoke`` runs every stage on the CPU with
a tiny model and a few dozen images (the test suite does); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BENCH_DATA, parse_cpus, pin_tree, place_cpus

BUCKET = "bench"
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
GOALS = "goal (issue 15): bucket cold >= 0.85x and warm >= 0.90x the ceiling, both >= 1.5x local CPU decode"


class Run:
    """The results so far, rewritten to ``out/gpu_node.json`` after every stage; the time budget."""

    def __init__(self, out: Path, budget: float, meta: dict[str, Any]) -> None:
        self.path = out / "gpu_node.json"
        self.deadline = time.monotonic() + budget
        self.data: dict[str, Any] = {"meta": meta, "goals": GOALS, "stages": {}}
        out.mkdir(parents=True, exist_ok=True)
        self.save()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stage(self, name: str, need: float, fn: Any, *args: Any) -> Any:
        if self.left() < need:
            self.data["stages"][name] = {"skipped": f"{self.left():.0f} s left, {need:.0f} s needed"}
            self.save()
            print(f"== {name}: skipped (out of time)", flush=True)
            return None
        print(f"== {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except Exception as exc:  # recorded, and the next stages still run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(result, dict):
            result.setdefault("stage_s", round(time.perf_counter() - t0, 1))
        self.data["stages"][name] = result
        self.save()
        print(f"   {json.dumps(result)[:600]}", flush=True)
        return result

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


# -- the model and its training steps ----------------------------------------------------------------
def _model(smoke: bool, classes: int, device: Any) -> Any:
    import torch

    if smoke:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(8, classes),
        )  # fmt: skip
    else:
        import torchvision

        model = torchvision.models.resnet50(num_classes=classes)
    return model.to(device, memory_format=torch.channels_last)


class Trainer:
    def __init__(self, smoke: bool, classes: int, device: Any) -> None:
        import torch

        torch.backends.cudnn.benchmark = True
        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"
        self.model = _model(smoke, classes, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, x: Any, y: Any) -> None:
        torch = self.torch
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def epoch(self, batches: Any, prepare: Any = None) -> dict[str, Any]:
        """Train over ``batches``: images/s, the loop's wait share, its CPU ms/image, first batch s."""
        self.sync()
        t0, c0 = time.perf_counter(), time.process_time()
        waited, images, first = 0.0, 0, None
        it = iter(batches)
        while True:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            waited += now - t
            first = now - t0 if first is None else first
            if prepare is not None:
                x, y = prepare(x, y)
            self.step(x, y)
            images += int(y.shape[0])
        self.sync()
        seconds = time.perf_counter() - t0
        return {
            "images": images, "seconds": round(seconds, 3),
            "images_per_s": images / seconds if seconds else 0.0,
            "wait": waited / seconds if seconds else 0.0, "first_batch_s": first or 0.0,
            "trainer_cpu_ms_per_image": (time.process_time() - c0) * 1e3 / images if images else 0.0,
        }  # fmt: skip


def _synthetic(trainer: Trainer, args: argparse.Namespace) -> dict[str, Any]:
    torch = trainer.torch
    x = torch.randn(args.batch, 3, args.size, args.size, device=trainer.device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, args.classes, (args.batch,), device=trainer.device)
    warm = trainer.epoch([(x, y)] * args.warmup)  # cuDNN autotuning, the allocator: not timed
    row = trainer.epoch([(x, y)] * args.steps)
    row["warmup_s"] = warm["seconds"]
    return row


# -- stages ---------------------------------------------------------------------------------------------
def _versions(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch

    import blobdata
    from blobdata.gpu import _decoders

    out: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "blobdata": blobdata.__version__, "cpus": os.cpu_count(), "device": str(device),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    }  # fmt: skip
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        with contextlib.suppress(Exception):
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()  # fmt: skip
    for module in ("nvidia.nvimgcodec", "torchvision"):
        try:
            mod = __import__(module, fromlist=["_"])
            out[module] = getattr(mod, "__version__", "?")
        except Exception as exc:
            out[module] = f"unavailable: {type(exc).__name__}: {exc}"
    if device.type == "cuda":  # the hardware decoder, alone, on baseline JPEGs
        from gpu_images import image

        baseline = [d for k, d in (image(i, 99) for i in range(64)) if k == "baseline 4:2:0"][:16]
        import numpy as np

        try:
            hw = _decoders.NvImageCodec(device, backends="hw")
            got = hw([np.frombuffer(d, dtype=np.uint8).copy() for d in baseline], device)
            out["hw_decoder"] = {"baseline_jpegs": len(baseline), "decoded": sum(g is not None for g in got)}
        except Exception as exc:
            out["hw_decoder"] = f"unavailable: {type(exc).__name__}: {exc}"
    with contextlib.suppress(OSError):
        maps = Path("/proc/self/maps").read_text()
        out["nvjpeg_loaded"] = sorted({line.split()[-1] for line in maps.splitlines() if "libnvjpeg" in line})
    return out


def _images(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_images import folder

    meta = folder(args.root, args.images, classes=args.classes, seed=0)
    return {k: v for k, v in meta.items() if k not in ("keys", "classes")}


def _decode_rows(args: argparse.Namespace, device: Any, datas: list[bytes]) -> dict[str, Any]:
    from bench_gpu_decode import measure

    rows: dict[str, Any] = {}
    kinds = ["gpu"] if device.type == "cpu" else ["hw", "gpu", "default", "torchvision"]
    for kind in kinds:
        try:
            r = measure(datas, device=device, batch=args.batch, decoder=kind, repeat=2, size=args.size)
        except Exception as exc:
            rows[kind] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        rows[kind] = {
            "decoder": r["decoder"], "refused": r["refused"], "worker_decoded": r["worker_decoded"],
            "decode": r["rows"]["decode"], "transform": r["rows"]["TrainTransform.apply"],
            "all": r["rows"]["all: samples, decode, draw, transform"],
            "mean_abs_diff_vs_pillow": r["mean_abs_diff_vs_pillow"],
        }  # fmt: skip
    return rows


def _decode(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    datas = _mix_bytes(args, args.decode_images)
    dmon = _dmon_start() if device.type == "cuda" else None
    idle = _decode_rows(args, device, datas)
    out: dict[str, Any] = {"images": len(datas), "gpu_idle": idle, "jpeg_engine": _dmon_stop(dmon)}
    beside = _beside_start(args)
    try:
        out["with_resnet50_training"] = _decode_rows(args, device, datas)
    finally:
        out["trainer_beside"] = _beside_stop(beside)
    return out


def _in_memory(trainer: Trainer, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch
    from bench_gpu_decode import raw_batches

    from blobdata import gpu
    from blobdata.gpu._pipeline import DevicePipeline

    raws = raw_batches(_mix_bytes(args, args.decode_images), args.batch)
    raws = [r for r in raws if len(r.urls) == args.batch] or raws
    dtype = torch.bfloat16 if trainer.cuda else torch.float32
    pipeline = DevicePipeline(gpu.TrainTransform(args.size, mean=MEAN, std=STD, dtype=dtype), device)
    targets = [torch.tensor([t % args.classes for t in r.targets]) for r in raws]
    feed = [r._replace(targets=t.tolist()) for r, t in zip(raws, targets, strict=True)]
    trainer.epoch(_present(pipeline(iter(feed[:2]))))  # warm-up: the decoder, the kernels
    return trainer.epoch(_present(pipeline(itertools.islice(itertools.cycle(feed), args.steps))))


def _present(batches: Any) -> Any:
    return (b for b in batches if b is not None)


def _local_cpu(trainer: Trainer, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch

    keys = json.loads((args.root / "index.json").read_text())["keys"]
    ds = _LocalFolder(str(args.root), keys, args.size)
    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                         pin_memory=trainer.cuda, drop_last=True)  # fmt: skip
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def prepare(x: Any, y: Any) -> tuple[Any, Any]:
        x = x.to(device, non_blocking=True).float().sub_(mean).div_(std)
        return x.contiguous(memory_format=torch.channels_last), y.to(device, non_blocking=True)

    return trainer.epoch(loader, prepare)


class _LocalFolder:
    """The usual map-style Dataset on local disk: read, Pillow decode, random-resized crop, flip."""

    def __init__(self, root: str, keys: list[str], size: int) -> None:
        from blobdata.testing import TrainTransform

        self.paths = [os.path.join(root, k) for k in keys]
        self.targets = [int(k.split("/")[1][1:]) for k in keys]
        self.transform = TrainTransform(size)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        with Image.open(self.paths[i]) as img:
            return self.transform(img.convert("RGB")), self.targets[i]


def _bucket(trainer: Trainer, args: argparse.Namespace, device: Any, run: Run) -> None:
    import torch
    from bench_latency import _s3_client, settle_server

    from blobdata import BlobCache, FolderDataset, gpu
    from blobdata.testing import LatencyProxy, LocalS3Server, upload

    keys = json.loads((args.root / "index.json").read_text())["keys"]
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        server = stack.enter_context(LocalS3Server(backend="moto" if args.smoke else "seaweedfs"))
        if args.server_cpus:
            pin_tree(server.pid, args.server_cpus)
        s3 = _s3_client(server.endpoint_url, server)
        s3.create_bucket(Bucket=BUCKET)
        upload(s3, BUCKET, ((k, (args.root / k).read_bytes()) for k in keys))
        if not args.smoke:
            settle_server(s3, keys)
        host, port = server.endpoint_url.rsplit("/", 1)[-1].rsplit(":", 1)
        endpoint = server.endpoint_url
        if args.rtt > 0:
            endpoint = stack.enter_context(
                LatencyProxy(host, int(port), delay_s=args.rtt / 2000)
            ).endpoint_url
        setup_s = time.perf_counter() - t0
        scratch = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=BENCH_DATA))
        os.environ["BLOBDATA_CACHE_HOME"] = str(scratch / "home")
        cache = BlobCache(scratch / "cache", size_limit="100GB")
        ds = FolderDataset(f"s3://{BUCKET}/train", cache=cache,
                           storage_options={**server.storage_options, "endpoint_url": endpoint})  # fmt: skip
        dtype = torch.bfloat16 if trainer.cuda else torch.float32
        loader = ds.dataloader(batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True,
                               device=device, gpu_transform=gpu.TrainTransform(args.size, mean=MEAN, std=STD,
                                                                               dtype=dtype))  # fmt: skip

        def epoch(name: str) -> dict[str, Any]:
            before = loader.stats()
            row = trainer.epoch(loader)
            ds.close()  # flushes this process's cache writes
            after = loader.stats()
            reads = (after.samples_from_cache + after.samples_from_bucket) - (
                before.samples_from_cache + before.samples_from_bucket
            )
            row["hit_rate"] = (after.samples_from_cache - before.samples_from_cache) / reads if reads else 0.0
            for field in ("device_decoded", "device_refused", "worker_decoded"):
                row[field] = getattr(after, field) - getattr(before, field)
            row["setup_s"] = round(setup_s, 1) if name == "bucket_cold" else 0.0
            return row

        need = 2 * len(keys) / 1000 + 20
        run.stage("bucket_cold", need, epoch, "bucket_cold")
        run.stage("bucket_warm", need, epoch, "bucket_warm")


# -- helpers: the images, the trainer beside, nvidia-smi dmon -----------------------------------------------
def _mix_bytes(args: argparse.Namespace, n: int) -> list[bytes]:
    keys = json.loads((args.root / "index.json").read_text())["keys"]
    return [(args.root / k).read_bytes() for k in keys[:n]]


def _beside_start(args: argparse.Namespace) -> Any:
    flag = Path(tempfile.mkdtemp(prefix="beside-")) / "ready"
    cmd = [
        sys.executable,
        __file__,
        "--beside",
        str(flag),
        "--batch",
        str(args.batch),
        "--size",
        str(args.size),
    ]
    proc = subprocess.Popen(cmd + (["--smoke"] if args.smoke else []))
    deadline = time.monotonic() + 120
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc, flag


def _beside_stop(beside: Any) -> dict[str, Any]:
    proc, flag = beside
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(flag.read_text()))
    return {"error": "the trainer beside did not start"}


def _beside_main(args: argparse.Namespace) -> int:
    """Train ResNet-50 on synthetic batches until terminated (another process, beside the decode)."""
    import signal

    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    trainer = Trainer(args.smoke, args.classes, device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device).contiguous(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, args.classes, (args.batch,), device=device)
    for _ in range(3):
        trainer.step(x, y)
    trainer.sync()
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    steps, t0 = 0, time.perf_counter()
    Path(args.beside).write_text(json.dumps({"started": True}))
    while not stopping[0]:
        trainer.step(x, y)
        steps += 1
        if steps % 10 == 0:
            trainer.sync()
    trainer.sync()
    seconds = time.perf_counter() - t0
    Path(args.beside).write_text(json.dumps({"steps": steps, "images_per_s": steps * args.batch / seconds}))
    return 0


def _dmon_start() -> Any:
    with contextlib.suppress(OSError):
        return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    return None


def _dmon_stop(proc: Any) -> Any:
    if proc is None:
        return None
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    lines = out.splitlines()
    header = next((ln.lstrip("#").split() for ln in lines if ln.startswith("#") and "sm" in ln), None)
    if header is None or "jpg" not in header:
        return {"raw": lines[:40]}
    col = header.index("jpg")
    values = [
        int(p[col])
        for ln in lines
        if not ln.startswith("#") and len(p := ln.split()) > col and p[col].isdigit()
    ]
    return {"jpg_util_max_percent": max(values, default=0), "samples": len(values)}


# -- main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--out", default=os.environ.get("OUT") or "gpu-node-results", help="where gpu_node.json goes"
    )
    p.add_argument("--images", type=int, default=8192, help="images in the bucket and on local disk")
    p.add_argument(
        "--decode-images", type=int, default=1024, help="images of the decode and in-memory stages"
    )
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=100, help="timed steps of the synthetic and in-memory rows")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps before the synthetic row")
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--rtt", type=float, default=50.0, help="round-trip time added by the proxy, ms")
    p.add_argument("--budget", type=float, default=540.0, help="seconds this run may take")
    p.add_argument("--client-cpus", help="CPUs of the trainer and its workers, e.g. 0-11")
    p.add_argument("--server-cpus", help="CPUs of the S3 server and the proxy, e.g. 12-15")
    p.add_argument("--smoke", action="store_true", help="every stage, tiny, on the CPU")
    p.add_argument("--beside", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.images, args.decode_images = min(args.images, 48), min(args.decode_images, 16)
        args.classes, args.batch, args.size, args.steps, args.warmup = 4, 8, 32, 3, 1
        args.workers = min(args.workers, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.beside:
        return _beside_main(args)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    device = torch.device(
        "cpu" if args.smoke else "cuda", None if args.smoke else torch.cuda.current_device()
    )
    client, server_cpus, placement = place_cpus(parse_cpus(args.client_cpus), parse_cpus(args.server_cpus))
    args.server_cpus = server_cpus
    if client:
        os.sched_setaffinity(0, client)
    BENCH_DATA.mkdir(exist_ok=True)
    args.root = BENCH_DATA / f"gpu-mix-{args.images}x{args.classes}"
    meta = {"argv": sys.argv[1:], "placement": placement, "smoke": args.smoke, "started": time.time()}
    run = Run(Path(args.out), args.budget, meta)
    run.stage("versions", 5, _versions, args, device)
    run.stage("images", 10, _images, args)
    run.stage("decode", 30, _decode, args, device)
    trainer = Trainer(args.smoke, args.classes, device)
    synthetic = run.stage("synthetic", 20, _synthetic, trainer, args)
    run.stage("in_memory", 20, _in_memory, trainer, args, device)
    run.stage("local_cpu", 30, _local_cpu, trainer, args, device)
    if run.left() > 60:
        _bucket(trainer, args, device, run)
    ceiling = (synthetic or {}).get("images_per_s")
    local = (run.data["stages"].get("local_cpu") or {}).get("images_per_s")
    for row in run.data["stages"].values():
        if isinstance(row, dict) and "images_per_s" in row and ceiling:
            row["x_ceiling"] = row["images_per_s"] / ceiling
            row["x_local_cpu"] = row["images_per_s"] / local if local else None
    run.data["meta"]["total_s"] = round(time.time() - meta["started"], 1)
    run.save()
    rows = {k: v for k, v in run.data["stages"].items() if isinstance(v, dict) and "images_per_s" in v}
    fields = ("images_per_s", "x_ceiling", "wait")
    print(json.dumps({k: {f: v.get(f) for f in fields} for k, v in rows.items()}))
    failed = [
        k for k, v in run.data["stages"].items() if isinstance(v, dict) and ("error" in v or "skipped" in v)
    ]
    print(f"done in {run.data['meta']['total_s']} s; {GOALS}; stages failed or skipped: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

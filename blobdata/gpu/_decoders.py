"""The device's JPEG decoders: nvImageCodec, torchvision's nvJPEG, Pillow on ``device="cpu"``; one per device.

A decoder is a callable ``(datas, device) -> images``: ``datas`` are uint8 numpy arrays (views of a
batch's bytes: nothing is copied per sample), and the result holds one entry per input, a uint8 CHW
RGB tensor on ``device`` or None where the decoder refused that sample (the caller then decodes it
with Pillow and counts it). A decoder that returns another number of entries is an error; an
out-of-memory error always propagates.

Decoders are made lazily, one per device, by :func:`for_device` in the thread that decodes (the
loader's decode thread, after ``torch.cuda.set_device``): nothing binds to a GPU, starts threads or
creates CUDA streams when a loader is built, before its workers fork, and under DDP each rank's
decoder runs on its own GPU. nvImageCodec is asked for its GPU backends only (the hardware decoder of
A100/H100-class GPUs, then CUDA) with few CPU threads, EXIF orientation off and libjpeg's "fancy"
chroma upsampling on, so that it decodes a JPEG as Pillow and torchvision do.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
import torch.utils.dlpack

from .._errors import BlobdataError, ConfigError
from ._jpeg import cpu_pixels

__all__ = [
    "MIN_NVIMGCODEC", "DeviceDecoder", "NvImageCodec", "PillowDecoder", "TorchvisionDecoder", "available",
    "for_device",
]  # fmt: skip

_log = logging.getLogger("blobdata")

#: nvImageCodec 0.4 and older leave a sample that fails out of the result (the images after it then
#: answer for the wrong samples); 0.5 returns None in its place.
MIN_NVIMGCODEC = (0, 5, 0)
#: CPU threads of each nvImageCodec decoder: its GPU backends need few (parsing, Huffman of small
#: images), and the cores belong to the DataLoader workers.
DECODER_THREADS = 2


class DeviceDecoder(Protocol):
    """Decodes a batch of JPEGs on a device (see the module docstring)."""

    name: str

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]: ...


class PillowDecoder:
    """``device="cpu"``'s decoder: Pillow, sample by sample (None for what it cannot decode)."""

    name = "Pillow"

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for d in datas:
            try:
                pixels = np.array(cpu_pixels(d.tobytes(), ""))  # writable, for torch
            except BlobdataError:
                out.append(None)
            else:
                out.append(torch.from_numpy(pixels).permute(2, 0, 1).to(device))
        return out


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class NvImageCodec:
    """nvImageCodec's batched decoder on one device.

    ``backends``: ``"gpu"`` (default) the hardware decoder then CUDA, nothing on the CPU; ``"hw"`` the
    hardware decoder alone (what it refuses comes back None: the benchmark's check that it is used);
    ``"default"`` nvImageCodec's own defaults (every backend, CPU included, its default threads).
    """

    name = "nvImageCodec"

    def __init__(
        self, device: torch.device, *, backends: str = "gpu", threads: int = DECODER_THREADS
    ) -> None:
        from nvidia import nvimgcodec  # type: ignore[import-not-found]

        self.version = str(getattr(nvimgcodec, "__version__", "0"))
        if _version(self.version) < MIN_NVIMGCODEC:
            raise ConfigError(
                f"nvImageCodec {self.version} leaves undecodable samples out of its result; blobdata needs "
                f"nvidia-nvimgcodec >= {'.'.join(map(str, MIN_NVIMGCODEC))}"
            )
        index = device.index if device.type == "cuda" and device.index is not None else 0
        if backends == "default":
            self._decoder = nvimgcodec.Decoder(device_id=index)
        else:
            kinds = {
                "hw": [nvimgcodec.BackendKind.HW_GPU_ONLY],
                "gpu": [nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.GPU_ONLY],
            }[backends]
            self._decoder = nvimgcodec.Decoder(
                device_id=index,
                max_num_cpu_threads=threads,
                backends=[nvimgcodec.Backend(k) for k in kinds],
                options=":fancy_upsampling=1",  # libjpeg's (Pillow's, torchvision's) chroma upsampling
            )
        # Pillow and torchvision leave EXIF orientation alone; nvImageCodec applies it by default.
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False)
        self.name = f"nvImageCodec {self.version}" + ("" if backends == "gpu" else f" ({backends})")
        self._lock = threading.Lock()  # one decode at a time per decoder (two loaders may share it)

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        # Decoded on the caller's current stream (the loader's side stream); DLPack then hands each
        # image to torch on that same stream (torch passes its current stream to __dlpack__), so the
        # kernels that read it are ordered after the decode without a host sync.
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        with self._lock:
            images = self._decoder.decode(datas, params=self._params, cuda_stream=stream)
        _check_count(self.name, images, datas)
        dlpack = torch.utils.dlpack.from_dlpack
        return [None if img is None else dlpack(img).permute(2, 0, 1) for img in images]


class TorchvisionDecoder:
    """torchvision's batched nvJPEG ``decode_jpeg`` (RGB; EXIF orientation not applied)."""

    name = "torchvision"

    def __init__(self, device: torch.device) -> None:
        import torchvision  # type: ignore[import-not-found, unused-ignore]
        from torchvision.io import ImageReadMode, decode_jpeg  # type: ignore[import-not-found, unused-ignore]

        self._decode: Callable[..., Any] = decode_jpeg
        self._mode = ImageReadMode.RGB
        self.name = f"torchvision {getattr(torchvision, '__version__', '?')}"

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        raw = [torch.from_numpy(d) for d in datas]  # views of the batch's bytes, no copy
        try:
            out: list[torch.Tensor | None] = list(self._decode(raw, mode=self._mode, device=device))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # one refused image fails the batch: decode one by one
            out = []
            for r in raw:
                try:
                    out.append(self._decode(r, mode=self._mode, device=device))
                except torch.OutOfMemoryError:
                    raise
                except RuntimeError:
                    out.append(None)
        _check_count(self.name, out, datas)
        return out


def _check_count(name: str, images: Any, datas: list[np.ndarray]) -> None:
    if len(images) != len(datas):
        raise BlobdataError(
            f"the GPU decoder {name} returned {len(images)} images for {len(datas)} JPEGs: its images cannot "
            f"be matched to their samples (nvidia-nvimgcodec >= {'.'.join(map(str, MIN_NVIMGCODEC))} "
            "returns None for each sample it cannot decode)"
        )


_made: dict[tuple[str, int | None], DeviceDecoder] = {}
_made_lock = threading.Lock()
unusable: list[str] = []  # GPU decoders installed here that failed to start, and why


def for_device(device: torch.device) -> DeviceDecoder:
    """The decoder of ``device``, made on first use, in the calling thread (after its set_device).

    An installed decoder that cannot start here (nvImageCodec built for a newer CUDA than the
    driver's, or older than :data:`MIN_NVIMGCODEC`) is passed over with a warning saying why;
    :class:`~blobdata.ConfigError` names every reason if none is left.
    """
    if device.type == "cpu":
        return PillowDecoder()
    key = (device.type, device.index)
    with _made_lock:
        decoder = _made.get(key)
        if decoder is None:
            decoder = _made[key] = _make(device)
        return decoder


def _make(device: torch.device) -> DeviceDecoder:
    unusable.clear()
    makers: list[tuple[str, str, Callable[[torch.device], DeviceDecoder]]] = [
        ("nvImageCodec", "nvidia.nvimgcodec", NvImageCodec),
        ("torchvision", "torchvision", TorchvisionDecoder),
    ]
    for name, module, make in makers:
        try:
            return make(device)
        except ImportError as exc:
            if exc.name not in (module, module.split(".")[0]) or not isinstance(exc, ModuleNotFoundError):
                _pass_over(name, exc)  # there, but its libraries do not load
        except Exception as exc:  # installed, but not usable with this driver, device or version
            _pass_over(name, exc)
    why = "".join(f"; {u}" for u in unusable)
    raise ConfigError(
        "GPU decoding needs nvImageCodec or torchvision: pip install 'blobdata[gpu]' "
        f"(nvidia-nvimgcodec-cu13 and torchvision), or decode on the CPU{why}"
    )


def _pass_over(name: str, exc: BaseException) -> None:
    why = f"{name} is installed but cannot decode here ({type(exc).__name__}: {exc})"
    unusable.append(why)
    _log.warning("blobdata.gpu: %s; trying the next decoder", why)


def available() -> bool:
    """Whether a GPU decoder is installed (found, not imported: nothing is loaded or started)."""
    for module in ("nvidia.nvimgcodec", "torchvision"):
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def forget() -> None:
    """Drop the decoders made so far (tests; a later call makes new ones)."""
    with _made_lock:
        _made.clear()
    unusable.clear()

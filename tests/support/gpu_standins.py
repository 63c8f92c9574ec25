"""A stand-in for ``nvidia.nvimgcodec`` that runs on the CPU, for testing blobdata's use of its API.

The real package needs a GPU. This one has the same names and signatures that blobdata calls
(``Decoder(device_id=, max_num_cpu_threads=, backends=, options=)``, ``decode(srcs, *, params=,
cuda_stream=)``, ``DecodeParams(apply_exif_orientation=)``, ``Backend``, ``BackendKind``, images that
export DLPack), decodes with Pillow, and copies the real one's defaults that matter: EXIF orientation
applied unless ``DecodeParams(apply_exif_orientation=False)``, plain (not libjpeg's "fancy") chroma
upsampling unless ``options`` enables it, and, when only the hardware backend is allowed, no
progressive JPEGs. ``STATE`` records what blobdata asked for and injects failures.
"""

from __future__ import annotations

import enum
import importlib
import io
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.version = "0.8.0"
        self.created: list[dict[str, Any]] = []  # each Decoder's arguments and the thread that made it
        self.calls: list[dict[str, Any]] = []  # each decode's batch size, params, cuda_stream
        self.dlpack_streams: list[Any] = []
        self.refuse: set[int] = set()  # positions (in a decode call) returned as None
        self.leave_out_failed = False  # nvImageCodec <= 0.4: failed samples left out of the result


STATE = _State()


class BackendKind(enum.Enum):
    CPU_ONLY = 1
    GPU_ONLY = 2
    HYBRID_CPU_GPU = 3
    HW_GPU_ONLY = 4


class Backend:
    def __init__(self, backend_kind: BackendKind, load_hint: float = 1.0) -> None:
        self.backend_kind = backend_kind
        self.load_hint = load_hint


class DecodeParams:
    def __init__(
        self, apply_exif_orientation: bool = True, color_spec: Any = None, allow_any_depth: bool = False
    ) -> None:
        self.apply_exif_orientation = apply_exif_orientation


class Image_:
    """A decoded image: HWC uint8, exported through DLPack only."""

    def __init__(self, hwc: torch.Tensor) -> None:
        self._t = hwc

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        STATE.dlpack_streams.append(stream)
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._t.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> Any:  # torch ignores its stream field: must not be used
        raise AssertionError("__cuda_array_interface__ used instead of DLPack")


class Decoder:
    def __init__(
        self,
        device_id: int = -1,
        max_num_cpu_threads: int = 0,
        backends: list[Backend] | None = None,
        options: str = ":fancy_upsampling=0",
    ) -> None:
        self.kinds = [b.backend_kind for b in backends] if backends else list(BackendKind)
        self.fancy = ":fancy_upsampling=1" in options.split()
        STATE.created.append({
            "device_id": device_id, "threads": max_num_cpu_threads, "kinds": self.kinds, "options": options,
            "thread": threading.current_thread().name,
        })  # fmt: skip

    def decode(
        self, srcs: list[Any], *, params: DecodeParams | None = None, cuda_stream: int = 0
    ) -> list[Any]:
        params = params if params is not None else DecodeParams()
        call = {"n": len(srcs), "exif": params.apply_exif_orientation, "cuda_stream": cuda_stream}
        STATE.calls.append(call)
        out: list[Any] = []
        for k, src in enumerate(srcs):
            data = np.asarray(src, dtype=np.uint8).tobytes()
            img = None if k in STATE.refuse else self._decode(data, params)
            if img is None and STATE.leave_out_failed:
                continue
            out.append(img)
        return out

    def _decode(self, data: bytes, params: DecodeParams) -> Image_ | None:
        try:
            with Image.open(io.BytesIO(data)) as img:
                if img.format != "JPEG" or img.mode not in ("RGB", "L"):
                    return None
                if self.kinds == [BackendKind.HW_GPU_ONLY] and img.info.get("progressive"):
                    return None  # the hardware decoder takes baseline JPEGs only
                img.load()
                if params.apply_exif_orientation:
                    img = ImageOps.exif_transpose(img)
                rgb = img.convert("RGB")
                if not self.fancy and img.mode == "RGB":
                    rgb = _plain_upsampling(rgb)
        except Exception:
            return None
        return Image_(torch.from_numpy(np.array(rgb)))


def _plain_upsampling(rgb: Image.Image) -> Image.Image:
    """What a decoder without libjpeg's fancy upsampling gives a 4:2:0 JPEG: each chroma sample repeated
    over its 2x2 pixels (here from the fancy result's chroma, averaged back per 2x2 block)."""
    ycc = np.asarray(rgb.convert("YCbCr")).astype(np.float32)
    h, w = ycc.shape[:2]
    for c in (1, 2):
        ch = ycc[: h - h % 2, : w - w % 2, c]
        block = ch.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3))
        ycc[: h - h % 2, : w - w % 2, c] = np.repeat(np.repeat(block, 2, axis=0), 2, axis=1)
    out = Image.fromarray(np.clip(np.rint(ycc), 0, 255).astype(np.uint8), "YCbCr")
    return out.convert("RGB")


def swap(monkeypatch: pytest.MonkeyPatch, package: str, module: str) -> None:
    """Import ``module`` (of ``package``) afresh from the front of ``sys.path`` for this test only: the
    entries of ``sys.modules`` it replaces come back after the test, and those it adds leave."""
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.import_module(module)
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        value = sys.modules.pop(name)
        monkeypatch.setitem(sys.modules, name, value)


def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, version: str = "0.8.0") -> _State:
    """Make ``from nvidia import nvimgcodec`` import this stand-in for the test; returns its state."""
    pkg = tmp_path / "standin" / "nvidia" / "nvimgcodec"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(
        "from tests.support.gpu_standins import (\n"
        "    Backend, BackendKind, DecodeParams, Decoder, STATE, Image_ as Image,\n"
        ")\n"
        "__version__ = STATE.version\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "standin"))
    STATE.reset()
    STATE.version = version
    swap(monkeypatch, "nvidia", "nvidia.nvimgcodec")
    return STATE

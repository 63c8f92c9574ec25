"""The device decoders on the CPU: nvImageCodec's API through a stand-in (tests/support/gpu_standins.py),
torchvision's through a stand-in module, and the checks around them (issue 25, items 1-6). The
CUDA-only checks of the real decoders skip where there is no GPU."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from blobdata import BlobdataError, ConfigError, DecodeError, FolderDataset, gpu
from blobdata.gpu import _decoders
from blobdata.gpu._jpeg import read_header
from tests.support import gpu_standins

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_decoders() -> Any:
    _decoders.forget()
    yield
    _decoders.forget()


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth colour with sharp edges: chroma detail that 4:2:0 upsampling methods render differently."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 6 + 1, w // 6 + 1, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(base).resize((w, h), Image.Resampling.NEAREST))


def _jpeg(pixels: np.ndarray, **save: Any) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, **save)
    return buf.getvalue()


def _exif_rotated_420() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": Pillow and torchvision leave the pixels as stored
    return _jpeg(_photo(40, 64), exif=exif.tobytes(), subsampling=2)  # 4:2:0


def _pillow(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


# -- 1. decoders made lazily, one per device, in the decoding thread -----------------------------------
def test_building_a_cuda_loader_starts_no_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    root = tmp_path / "d" / "a"
    root.mkdir(parents=True)
    (root / "0.jpg").write_bytes(_jpeg(_photo(20, 30)))
    ds = FolderDataset(tmp_path / "d")
    assert gpu.check_device("cuda:1") == torch.device("cuda", 1)
    ds.dataloader(batch_size=2, num_workers=2, device="cuda:1", gpu_transform=gpu.TrainTransform(8))
    # Nothing bound to a GPU, no decoder threads before the workers fork: made on the first batch.
    assert state.created == []
    with pytest.raises(ConfigError, match="torch sees 2 CUDA devices"):
        gpu.check_device("cuda:2")


def test_one_decoder_per_device_made_in_the_thread_that_decodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)
    made: list[Any] = []

    def decode_thread(index: int) -> None:
        made.append(_decoders.for_device(torch.device("cuda", index)))

    for index in (1, 1, 0):
        t = threading.Thread(target=decode_thread, args=(index,), name=f"decoder-of-{index}")
        t.start()
        t.join()
    assert made[0] is made[1] and made[2] is not made[0]  # one per device, reused
    assert [c["device_id"] for c in state.created] == [1, 0]
    assert [c["thread"] for c in state.created] == ["decoder-of-1", "decoder-of-0"]
    for c in state.created:  # few CPU threads, the GPU backends only, libjpeg's upsampling
        assert c["threads"] == _decoders.DECODER_THREADS <= 2
        kinds = gpu_standins.BackendKind
        assert c["kinds"] == [kinds.HW_GPU_ONLY, kinds.GPU_ONLY]
        assert ":fancy_upsampling=1" in c["options"].split()


def test_the_loader_makes_its_decoder_in_its_decode_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "d" / "a"
    root.mkdir(parents=True)
    for i in range(4):
        (root / f"{i}.jpg").write_bytes(_jpeg(_photo(20 + i, 30)))
    threads: list[str] = []
    real = _decoders.for_device

    def recording(device: torch.device) -> Any:
        threads.append(threading.current_thread().name)
        return real(device)

    monkeypatch.setattr(_decoders, "for_device", recording)
    ds = FolderDataset(tmp_path / "d")
    loader = ds.dataloader(batch_size=2, device="cpu", gpu_transform=gpu.TrainTransform(8))
    assert threads == []
    assert sum(len(t) for _, t in loader) == 4
    assert threads == ["blobdata-device-decode"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_images_are_decoded_on_the_loaders_device() -> None:  # pragma: no cover - GPU machines only
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    try:
        out = gpu.decode_batch([_jpeg(_photo(30, 40))], ["a"], device=dev)
    except ConfigError as exc:
        pytest.skip(str(exc))
    assert out[0].device == dev


# -- 2. the decompression-bomb rule, from the header, before a GPU decoder ------------------------------
def _bomb() -> bytes:
    """A small JPEG whose frame header claims 65,500 x 65,500 pixels."""
    data = bytearray(_jpeg(_photo(16, 16)))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (65500).to_bytes(2, "big") * 2
    return bytes(data)


class _Recording:
    """A device decoder that decodes with Pillow and remembers every JPEG it was given."""

    name = "recording"

    def __init__(self, refuse: int = 0) -> None:
        self.got: list[bytes] = []
        self.refuse = refuse  # refuse every n-th JPEG (None), as nvImageCodec does when its memory runs out

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for d in datas:
            self.got.append(d.tobytes())
            refused = self.refuse and len(self.got) % self.refuse == 0
            out.append(None if refused else _pillow(d.tobytes()).to(device))
        return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bomb_header_is_a_skippable_decode_error_before_the_gpu_decoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    bomb = _bomb()
    assert read_header(bomb) == (65500, 65500, True)
    root = tmp_path / "d"
    for i in range(4):
        (root / "a").mkdir(parents=True, exist_ok=True)
        (root / "a" / f"{i}.jpg").write_bytes(bomb if i == 2 else _jpeg(_photo(20, 24, i)))
    recording = _Recording()
    monkeypatch.setattr(_decoders, "for_device", lambda device: recording)
    with pytest.raises(DecodeError, match=r"2\.jpg: its JPEG header says 65500x65500") as info:
        list(FolderDataset(root).dataloader(batch_size=4, num_workers=workers, device="cpu",
                                            gpu_transform=gpu.TrainTransform(8)))  # fmt: skip
    assert info.value.url is not None and info.value.url.endswith("2.jpg")
    skipping = FolderDataset(root, on_error="skip")
    loader = skipping.dataloader(batch_size=4, num_workers=workers, device="cpu",
                                 gpu_transform=gpu.TrainTransform(8))  # fmt: skip
    assert sum(len(t) for _, t in loader) == 3
    ((url, exc),) = skipping.errors
    assert url.endswith("2.jpg") and "MAX_IMAGE_PIXELS" in str(exc)
    assert bomb not in recording.got  # the GPU decoder never saw it
    # decode_each applies the same rule before choosing the decoder.
    (err,) = gpu.decode_each([bomb], ["s3://b/bomb.jpg"], device="cpu")
    assert isinstance(err, DecodeError) and err.url == "s3://b/bomb.jpg"


# -- 3. refusals counted and warned about; out-of-memory errors propagate ------------------------------
def test_gpu_refusals_are_counted_and_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "d" / "a"
    root.mkdir(parents=True)
    for i in range(40):
        (root / f"{i:02d}.jpg").write_bytes(_jpeg(_photo(20, 24, i)))
    recording = _Recording(refuse=4)  # 10 of 40
    monkeypatch.setattr(_decoders, "for_device", lambda device: recording)
    ds = FolderDataset(tmp_path / "d")
    loader = ds.dataloader(batch_size=8, device="cpu", gpu_transform=gpu.TrainTransform(8))
    with caplog.at_level("WARNING", logger="blobdata"):
        assert sum(len(t) for _, t in loader) == 40  # the refused ones decoded with Pillow instead
    s = loader.stats()
    assert (s.device_decoded, s.device_refused, s.worker_decoded) == (30, 10, 0)
    warnings = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(warnings) == 1 and "recording" in warnings[0].getMessage()  # once, naming the decoder


class _OutOfMemory:
    name = "oom"

    def __call__(self, datas: list[np.ndarray], device: torch.device) -> list[torch.Tensor | None]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.00 GiB")


def test_an_out_of_memory_error_reaches_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "d" / "a"
    root.mkdir(parents=True)
    (root / "0.jpg").write_bytes(_jpeg(_photo(20, 24)))
    monkeypatch.setattr(_decoders, "for_device", lambda device: _OutOfMemory())
    ds = FolderDataset(tmp_path / "d")
    loader = ds.dataloader(batch_size=1, device="cpu", gpu_transform=gpu.TrainTransform(8))
    with pytest.raises(torch.OutOfMemoryError, match=r"13\.00 GiB"):
        list(loader)
    assert loader.stats().device_refused == 0


def _torchvision_standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    pkg = tmp_path / "tv" / "torchvision"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0-standin'\n")
    (pkg / "io" / "__init__.py").write_text(
        "import enum\nclass ImageReadMode(enum.Enum):\n    RGB = 3\n" + body
    )
    monkeypatch.syspath_prepend(str(tmp_path / "tv"))
    gpu_standins.swap(monkeypatch, "torchvision", "torchvision.io")


def test_torchvisions_out_of_memory_error_is_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchvision_standin(tmp_path, monkeypatch, (
        "import torch\n"
        "def decode_jpeg(input, mode, device):\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory')\n"
    ))  # fmt: skip
    decoder = _decoders.TorchvisionDecoder(CPU)
    with pytest.raises(torch.OutOfMemoryError):
        decoder([np.frombuffer(_jpeg(_photo(8, 8)), dtype=np.uint8).copy()], CPU)


def test_torchvision_gets_views_of_the_batch_and_refusals_come_back_as_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _torchvision_standin(tmp_path, monkeypatch, (
        "import torch\n"
        "SEEN = []\n"
        "def decode_jpeg(input, mode, device):\n"
        "    if isinstance(input, list):\n"
        "        SEEN.extend(t.data_ptr() for t in input)\n"
        "        raise RuntimeError('one image of the batch is not a JPEG')\n"
        "    if input[0] != 255:\n"
        "        raise RuntimeError('not a JPEG')\n"
        "    return torch.zeros(3, 2, 2, dtype=torch.uint8, device=device)\n"
    ))  # fmt: skip
    buf = np.frombuffer(b"\xff\xd8ab" + b"xyz" + b"\xff\xd8cd", dtype=np.uint8).copy()
    views = [buf[0:4], buf[4:7], buf[7:11]]
    out = _decoders.TorchvisionDecoder(CPU)(views, CPU)
    assert [o is None for o in out] == [False, True, False]
    seen = sys.modules["torchvision.io"].SEEN
    base = buf.ctypes.data
    assert seen == [base, base + 4, base + 7]  # the batch's own bytes: no bytearray copy per sample


# -- 4. the decoder's output count ---------------------------------------------------------------------
def test_a_decoder_that_returns_fewer_images_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)
    state.leave_out_failed, state.refuse = True, {1}  # what nvImageCodec <= 0.4 did with a failed sample
    decoder = _decoders.NvImageCodec(CPU)
    datas = [np.frombuffer(_jpeg(_photo(10, 12, i)), dtype=np.uint8).copy() for i in range(3)]
    with pytest.raises(BlobdataError, match=r"returned 2 images for 3 JPEGs.*nvimgcodec >= 0\.5\.0"):
        decoder(datas, CPU)
    state.leave_out_failed = False  # 0.5 and later: None in its place, decoded with Pillow by the caller
    assert [o is None for o in decoder(datas, CPU)] == [False, True, False]


def test_an_nvimagecodec_older_than_0_5_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu_standins.install(tmp_path, monkeypatch, version="0.4.1")
    with pytest.raises(ConfigError, match=r"nvImageCodec 0\.4\.1 leaves undecodable samples out.*>= 0\.5\.0"):
        _decoders.NvImageCodec(CPU)
    with caplog.at_level("WARNING", logger="blobdata"):
        try:
            _decoders._make(torch.device("cuda", 0))
        except ConfigError as exc:
            assert "nvImageCodec 0.4.1" in str(exc)
    assert "nvImageCodec is installed but cannot decode here (ConfigError: nvImageCodec 0.4.1" in caplog.text


# -- 5. the CPU and GPU paths decode a JPEG alike ---------------------------------------------------------
def test_the_cpu_path_leaves_exif_orientation_alone_like_pillow_and_torchvision() -> None:
    data = _exif_rotated_420()
    with Image.open(io.BytesIO(data)) as img:
        assert img.getexif()[0x0112] == 6 and img.size == (64, 40)
    (out,) = gpu.decode_batch([data], ["s3://b/rotated.jpg"], device="cpu")
    assert tuple(out.shape) == (3, 40, 64)  # as stored, not rotated to 64 x 40
    assert torch.equal(out, _pillow(data))
    try:
        from torchvision.io import decode_jpeg  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # pragma: no cover
    assert torch.equal(out, decode_jpeg(raw, mode=3))  # pragma: no cover


def test_nvimagecodec_is_asked_to_decode_as_pillow_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)
    rotated, plain = _exif_rotated_420(), _jpeg(_photo(48, 40, 3), subsampling=2)
    datas = [np.frombuffer(d, dtype=np.uint8).copy() for d in (rotated, plain)]
    # The stand-in does what nvImageCodec does by default: rotates, and upsamples chroma plainly.
    from nvidia import nvimgcodec  # type: ignore[import-not-found]

    defaults = nvimgcodec.Decoder().decode(datas)
    assert tuple(defaults[0]._t.shape) == (64, 40, 3)
    assert not torch.equal(defaults[1]._t.permute(2, 0, 1), _pillow(plain))
    got = _decoders.NvImageCodec(CPU)(datas, CPU)
    assert state.calls[-1]["exif"] is False
    for image, data in zip(got, (rotated, plain), strict=True):
        assert image is not None and torch.equal(image, _pillow(data))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_and_cpu_decode_an_exif_rotated_and_a_420_jpeg_alike() -> None:  # pragma: no cover - GPU only
    gray = _jpeg(_photo(64, 64, 6).mean(2).astype(np.uint8))
    datas = [_exif_rotated_420(), _jpeg(_photo(96, 80, 5), subsampling=2), gray]
    try:
        out = gpu.decode_batch(datas, ["r", "p", "g"], device="cuda")
    except ConfigError as exc:
        pytest.skip(str(exc))
    for a, data in zip(out, datas, strict=True):
        b = _pillow(data)
        assert a.shape == b.shape
        assert float((a.cpu().float() - b.float()).abs().mean()) < 1.0


# -- 6. DLPack on the caller's stream, no retry on another stream -----------------------------------------
def test_nvimagecodec_images_come_through_dlpack_on_the_callers_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)
    data = np.frombuffer(_jpeg(_photo(12, 16)), dtype=np.uint8).copy()
    (image,) = _decoders.NvImageCodec(CPU)([data], CPU)
    assert image is not None and tuple(image.shape) == (3, 12, 16)
    assert state.calls == [{"n": 1, "exif": False, "cuda_stream": 0}]  # the current stream (none on a CPU)
    assert len(state.dlpack_streams) == 1  # imported through __dlpack__ (its CUDA array interface raises)


def test_a_decode_without_a_stream_argument_is_not_retried_on_another_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = gpu_standins.install(tmp_path, monkeypatch)

    def old_decode(self: Any, srcs: list[Any], params: Any = None) -> list[Any]:
        state.calls.append({"n": len(srcs), "without a stream": True})
        return []

    monkeypatch.setattr(gpu_standins.Decoder, "decode", old_decode)
    with pytest.raises(TypeError, match="cuda_stream"):
        _decoders.NvImageCodec(CPU)([np.frombuffer(_jpeg(_photo(8, 8)), dtype=np.uint8).copy()], CPU)
    assert state.calls == []  # called once, with the stream, and not again without it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decoding_on_a_side_stream_is_ordered_before_its_readers() -> None:  # pragma: no cover - GPU only
    datas = [_jpeg(_photo(200, 300, i)) for i in range(8)]
    side = torch.cuda.Stream()
    try:
        with torch.cuda.stream(side):
            out = gpu.decode_batch(datas, [str(i) for i in range(8)], device="cuda")
            sums = torch.stack([o.float().sum() for o in out])  # read on the side stream, no sync between
        side.synchronize()
    except ConfigError as exc:
        pytest.skip(str(exc))
    want = torch.tensor([float(_pillow(d).float().sum()) for d in datas])
    assert torch.allclose(sums.cpu(), want, rtol=0.01)

"""Issue 29, findings 3 and 10: a JPEG's markers are walked before anything decodes it. A scan bomb (more
scans than ``MAX_SCANS``) is refused by the default loader, RandomResizedCrop and the device path's guard;
the device guard sizes a JPEG by the largest of all its frames."""

import io

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from blobdata import DecodeError
from blobdata._decode import check_jpeg, decode, decode_with, default_loader, walk_jpeg
from blobdata.gpu import decode_each
from blobdata.gpu._jpeg import prepare, read_header
from blobdata.transforms import RandomResizedCrop

URL = "s3://bucket/train/n01/bomb.jpg"
COPIES = 2000  # scans added to a 10-scan progressive JPEG: twice the limit


def _photo(h: int, w: int, mode: str = "RGB") -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(h * w).integers(0, 40, (h, w, 3))
    arr = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1) + noise
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).convert(mode)


def _jpeg(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90, **save)
    return buf.getvalue()


def _scan_bomb(base: bytes, copies: int, *, before_scan: bytes = b"") -> bytes:
    """``base`` with its last scan (header and entropy-coded data) repeated ``copies`` more times, each
    copy preceded by ``before_scan``: libjpeg decodes every copy (a progressive JPEG's cost is blocks x
    scans), as the 20,000 empty scans of the issue's 195 KB bomb."""
    last, end = base.rindex(b"\xff\xda"), base.rindex(b"\xff\xd9")
    return base[:end] + (before_scan + base[last:end]) * copies + base[end:]


def _pillow(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


# -- finding 3: scan bombs ------------------------------------------------------------------------------
def test_a_scan_bomb_is_refused_by_the_default_loader_the_crop_and_the_device_guard() -> None:
    base = _jpeg(_photo(48, 64), progressive=True, restart_marker_blocks=2)
    first_scan = base.index(b"\xff\xda")
    assert b"\xff\x00" in base[first_scan:] and b"\xff\xd0" in base[first_scan:]  # stuffing and RSTs
    bomb = _scan_bomb(base, COPIES)
    # Nothing refuses it on its own: Pillow decodes it, every scan of it (kept small to stay fast here;
    # at 8192 x 8192 each scan costs a core about 4 ms).
    assert _pillow(bomb).size == (64, 48)
    assert walk_jpeg(base) == (48, 64, 1, 10, True)
    assert walk_jpeg(bomb) == (48, 64, 1, 10 + COPIES, True)
    assert walk_jpeg(bomb, libjpeg=True) == walk_jpeg(bomb)  # progressive: libjpeg decodes every scan
    refusals = {
        "default loader": lambda: decode(bomb, URL, default_loader),
        "RandomResizedCrop": lambda: decode_with(RandomResizedCrop(16), bomb, URL),
        "device guard (worker)": lambda: prepare(bomb, URL),
    }
    for where, refuse in refusals.items():
        with pytest.raises(DecodeError, match=rf"{URL}: the JPEG has {10 + COPIES} scans") as info:
            refuse()
        assert info.value.url == URL, where
        assert "MAX_SCANS (1000)" in str(info.value) and "re-encode" in str(info.value), where
    (err,) = decode_each([bomb], [URL], device="cpu")  # the training process's guard
    assert isinstance(err, DecodeError) and err.url == URL and "scans" in str(err)
    # The limit itself passes; one more scan does not.
    at_limit = _scan_bomb(base, 1000 - 10)
    assert decode(at_limit, URL, default_loader).size == (64, 48)
    with pytest.raises(DecodeError, match="1001 scans"):
        decode(_scan_bomb(base, 1000 - 9), URL, default_loader)


def test_fill_bytes_and_garbage_before_markers_do_not_hide_scans() -> None:
    """libjpeg reads a marker after any number of fill 0xFF and skips stray bytes where a marker is
    due; the walk does the same, so neither hides a scan from the count."""
    base = _jpeg(_photo(32, 32), progressive=True)
    filled = _scan_bomb(base, COPIES, before_scan=b"\xff\xff\xff")
    assert _pillow(filled).size == (32, 32)
    assert walk_jpeg(filled) is not None and walk_jpeg(filled).scans == 10 + COPIES  # type: ignore[union-attr]
    dht = base.index(b"\xff\xc4")
    garbled = _scan_bomb(base[:dht] + b"\x12\x34\x00" + base[dht:], COPIES)  # libjpeg: "extraneous bytes"
    assert _pillow(garbled).size == (32, 32)
    for data in (filled, garbled):
        with pytest.raises(DecodeError, match=f"{10 + COPIES} scans"):
            decode(data, URL, default_loader)


def test_scan_markers_inside_segments_are_not_counted() -> None:
    """A segment is skipped by its length: 0xFFDA in a comment or an EXIF block is not a scan."""
    base = _jpeg(_photo(40, 40))
    payload = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00" * 6000  # 60 KB of fake scan headers
    com = b"".join(b"\xff\xfe" + (len(c) + 2).to_bytes(2, "big") + c for c in _chunks(payload, 60000))
    data = base[:2] + com + base[2:]
    assert data.count(b"\xff\xda") > 6000
    assert walk_jpeg(data) == (40, 40, 1, 1, True)
    assert decode(data, URL, default_loader).size == (40, 40)


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_libjpeg_decodes_only_the_one_interleaved_scan_of_a_baseline_jpeg() -> None:
    """The default loader's walk stops after a sequential JPEG's scan when it holds every component:
    libjpeg refuses a second SOS there before decoding it (checked here, so that a Pillow whose libjpeg
    did otherwise fails this test). The device guard still counts every scan."""
    base = _jpeg(_photo(64, 64))
    bomb = _scan_bomb(base, COPIES)
    assert walk_jpeg(bomb, libjpeg=True) == (64, 64, 1, 1, True)
    assert walk_jpeg(bomb) == (64, 64, 1, 1 + COPIES, True)
    with pytest.raises(DecodeError, match="broken data stream"):  # libjpeg's refusal, not ours
        decode(bomb, URL, default_loader)
    with pytest.raises(DecodeError, match=f"{1 + COPIES} scans"):
        prepare(bomb, URL)
    # A first scan with fewer components than the frame: libjpeg reads on, so does the walk.
    sos = bomb.index(b"\xff\xda")
    partial = bomb[: sos + 4] + b"\x01" + bomb[sos + 5 :]
    assert walk_jpeg(partial, libjpeg=True) == (64, 64, 1, 1 + COPIES, True)


def test_the_limit_is_read_when_checking(monkeypatch: pytest.MonkeyPatch) -> None:
    from blobdata._decode import jpeg

    data = _jpeg(_photo(16, 16), progressive=True)
    assert check_jpeg(data, URL) is not None
    monkeypatch.setattr(jpeg, "MAX_SCANS", 9)
    with pytest.raises(DecodeError, match=r"10 scans .*MAX_SCANS \(9\)"):
        check_jpeg(data, URL)


@given(st.binary(max_size=400))
def test_the_walk_never_raises_and_never_counts_more_scans_than_sos_bytes(tail: bytes) -> None:
    data = b"\xff\xd8" + tail
    markers = walk_jpeg(data)
    assert markers is not None and markers.scans <= data.count(b"\xff\xda")
    assert walk_jpeg(data, libjpeg=True) is not None


# -- finding 10: every frame -----------------------------------------------------------------------------
def _two_frames(*, second_after_scan: bool) -> bytes:
    """A 16 x 16 JPEG that also declares a 65,500 x 65,500 frame: in its header after the real one, or
    after its scan."""
    data = _jpeg(_photo(16, 16))
    sof = data.index(b"\xff\xc0")
    length = int.from_bytes(data[sof + 2 : sof + 4], "big")
    big = bytearray(data[sof : sof + 2 + length])
    big[5:9] = (65500).to_bytes(2, "big") * 2
    at = data.index(b"\xff\xd9") if second_after_scan else sof + 2 + length
    return data[:at] + bytes(big) + data[at:]


@pytest.mark.parametrize("second_after_scan", [False, True])
def test_the_device_guard_sizes_a_jpeg_by_its_largest_frame(second_after_scan: bool) -> None:
    data = _two_frames(second_after_scan=second_after_scan)
    assert read_header(data) == (65500, 65500, False)  # the largest; two frames: not the GPU's
    assert walk_jpeg(data) == (65500, 65500, 2, 1, False)
    with pytest.raises(DecodeError, match=r"its JPEG header says 65500x65500") as info:
        prepare(data, URL)
    assert info.value.url == URL
    (err,) = decode_each([data], [URL], device="cpu")
    assert isinstance(err, DecodeError) and "MAX_IMAGE_PIXELS" in str(err)

import io

import numpy as np
import pytest
from PIL import Image

from blobdata import DecodeError
from blobdata._decode import ObjectFile, decode, default_loader

URL = "s3://bucket/train/cls/a b+ü.jpg"


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    "fmt,mode",
    [
        ("JPEG", "RGB"),
        ("PNG", "RGBA"),
        ("PNG", "L"),
        ("BMP", "RGB"),
        ("TIFF", "RGB"),
        ("WEBP", "RGB"),
        ("PPM", "RGB"),
    ],
)
def test_default_loader_decodes_to_rgb_from_memory(fmt: str, mode: str) -> None:
    arr = (np.arange(12 * 10 * 3, dtype=np.uint8) % 251).reshape(10, 12, 3)
    img = Image.fromarray(arr).convert(mode)
    out = decode(_encode(img, fmt), URL, default_loader)
    assert out.mode == "RGB"
    assert out.size == (12, 10)


def test_truncated_jpeg_is_a_decode_error_naming_the_url() -> None:
    data = _encode(Image.new("RGB", (64, 64), "red"), "JPEG")
    with pytest.raises(DecodeError) as info:
        decode(data[: len(data) // 3], URL, default_loader)
    assert URL in str(info.value) and info.value.url == URL


@pytest.mark.parametrize(
    "payload",
    [
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        b"%PDF-1.4\n1 0 obj\n<<>>\nendobj\n",
        b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00"
        b"\x01\x00\x01\x00\x00\x02\x02D\x01\x00;",
        b"not an image at all",
    ],
)
def test_non_image_formats_are_refused_without_sniffing_plugins(payload: bytes) -> None:
    with pytest.raises(DecodeError, match="not an image"):
        decode(payload, URL, default_loader)


def test_decompression_bomb_is_an_error_not_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encode(Image.new("RGB", (100, 100)), "PNG")
    for limit in (100 * 100 - 1, 100 * 100 // 3):  # the warning band (1x-2x) and the error band (>2x)
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
        with pytest.raises(DecodeError, match="decompression bomb") as info:
            decode(data, URL, default_loader)
        assert info.value.url == URL


def test_custom_loader_gets_a_named_file_object_and_its_errors_are_wrapped() -> None:
    seen: list[ObjectFile] = []

    def loader(f: ObjectFile) -> bytes:
        seen.append(f)
        return f.read()

    assert decode(b"xyz", URL, loader) == b"xyz"
    assert seen[0].name == URL and seen[0].url == URL

    def broken(f: ObjectFile) -> None:
        raise KeyError("boom")

    with pytest.raises(DecodeError, match="KeyError") as info:
        decode(b"xyz", URL, broken)
    assert URL in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)

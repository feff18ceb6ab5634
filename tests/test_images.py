"""Request images to RGB pixels (router.request.images) and back to PIL (common.protocol.images): every accepted
image equals diffusers' load_image byte for byte, every bad one is a FieldError naming the field. Each
image is built here with Pillow. No engine."""

from __future__ import annotations

import base64
import functools
import io
import struct
import time
import tracemalloc
import warnings
import zlib

import numpy as np
import pytest
import torch
from diffusers.utils import load_image
from PIL import Image, ImageFile

from common.protocol.images import image_digest, image_from_array
from router.request.images import MAX_IMAGE_PIXELS, MIN_IMAGE_SIDE, decode_image
from router.core.errors import FieldError

RNG = np.random.default_rng(0)


def _pixels(h: int, w: int, channels: int) -> np.ndarray:
    a = RNG.integers(0, 256, (h, w, channels), dtype=np.uint8)
    return a[..., 0] if channels == 1 else a


def _file(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _with_orientation(im: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = im.getexif()
    exif[0x0112] = orientation
    return _file(im, fmt, exif=exif.tobytes())


def _frames(fmt: str, n: int, **kw) -> bytes:
    frames = [Image.fromarray(_pixels(32, 48, 3)) for _ in range(n)]
    return _file(frames[0], fmt, save_all=True, append_images=frames[1:], **kw)


RGB = Image.fromarray(_pixels(40, 56, 3))
RGBA = Image.fromarray(_pixels(40, 56, 4))
GRAY = Image.fromarray(_pixels(40, 56, 1))
ACCEPTED = {
    "rgb_png": _file(RGB, "PNG"),
    "rgb_jpeg": _file(RGB, "JPEG", quality=90),
    "progressive_jpeg": _file(RGB, "JPEG", progressive=True),
    "gray_png": _file(GRAY, "PNG"),
    "gray_jpeg": _file(GRAY, "JPEG"),
    "bilevel_png": _file(GRAY.convert("1"), "PNG"),
    "rgba_png": _file(RGBA, "PNG"),
    "la_png": _file(RGBA.convert("LA"), "PNG"),
    "palette_png": _file(RGB.quantize(64), "PNG"),
    "palette_transparent_png": _file(RGB.quantize(64), "PNG", transparency=3),
    "16bit_png": _file(Image.fromarray(RNG.integers(0, 65536, (40, 56), dtype=np.uint16)), "PNG"),
    "cmyk_jpeg": _file(RGB.convert("CMYK"), "JPEG"),
    "exif_rotated_jpeg": _with_orientation(RGB, "JPEG", 6),
    "exif_mirrored_png": _with_orientation(RGB, "PNG", 2),
    "exif_rotated_png": _with_orientation(RGBA, "PNG", 8),
    "lossless_webp": _file(RGB, "WEBP", lossless=True),
    "rgba_webp": _file(RGBA, "WEBP", quality=80),
    "mpo_jpeg": _frames("MPO", 2),  # a camera's JPEG with a second picture: the first one is the image
    "one_frame_apng": _frames("PNG", 1),
    "smallest_side": _file(Image.fromarray(_pixels(MIN_IMAGE_SIDE, 32 * MIN_IMAGE_SIDE, 3)), "PNG"),
    "trailing_bytes": _file(RGB, "PNG") + b"\0" * 100,  # load_image ignores what follows the file
}


def _reference(raw: bytes) -> np.ndarray:
    return np.asarray(load_image(Image.open(io.BytesIO(raw))))


@pytest.mark.parametrize("raw", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_images_are_load_images_pixels(raw):
    got = decode_image(_b64(raw))
    expected = _reference(raw)
    assert got.dtype == np.uint8 and got.ndim == 3 and got.shape[2] == 3 and got.flags.c_contiguous
    assert np.array_equal(got, expected)


def test_exif_orientation_is_applied():
    assert decode_image(_b64(ACCEPTED["exif_rotated_jpeg"])).shape == (56, 40, 3)
    assert np.array_equal(decode_image(_b64(ACCEPTED["exif_mirrored_png"])), np.asarray(RGB)[:, ::-1])


def _wrapped(s: str) -> str:
    return "\n".join(s[i:i + 76] for i in range(0, len(s), 76)) + "\n"


PNG = ACCEPTED["rgba_png"]
ENCODINGS = {
    "base64": _b64,
    "unpadded": lambda raw: _b64(raw).rstrip("="),
    "urlsafe": lambda raw: base64.urlsafe_b64encode(raw).decode(),
    "urlsafe_unpadded": lambda raw: base64.urlsafe_b64encode(raw).decode().rstrip("="),
    "mime_wrapped": lambda raw: _wrapped(_b64(raw)),
    "data_url": lambda raw: "data:image/png;base64," + _b64(raw),
    "data_url_upper_case": lambda raw: "DATA:IMAGE/PNG;BASE64," + _b64(raw),
    "data_url_with_parameter": lambda raw: "data:image/png;name=a.png;base64," + _wrapped(_b64(raw)),
}


@pytest.mark.parametrize("encode", ENCODINGS.values(), ids=ENCODINGS.keys())
def test_every_base64_spelling_decodes(encode):
    assert set(_b64(PNG)) & set("+/"), "the file's base64 must show what urlsafe changes"
    assert np.array_equal(decode_image(encode(PNG)), _reference(PNG))


@pytest.mark.parametrize("mime, fmt", [("image/jpeg", "rgb_jpeg"), ("image/jpg", "rgb_jpeg"),
                                       ("image/jpeg", "mpo_jpeg"), ("image/webp", "lossless_webp")])
def test_data_url_media_types(mime, fmt):
    raw = ACCEPTED[fmt]
    assert np.array_equal(decode_image(f"data:{mime};base64,{_b64(raw)}"), _reference(raw))


def _truncated(raw: bytes) -> str:
    return _b64(raw[:len(raw) // 2])


REFUSED = {
    "http_url": ("http://example.com/a.png", "the engine fetches nothing"),
    "https_url": ("https://example.com/a.png", "the engine fetches nothing"),
    "file_url": ("file:///etc/passwd", "the engine fetches nothing"),
    "ftp_url": ("ftp://example.com/a.png", "the engine fetches nothing"),
    "empty": ("", "empty"),
    "blank": (" \n ", "empty"),
    "empty_data_url": ("data:image/png;base64,", "empty"),
    "padding_only": ("====", "empty"),
    "not_base64": ("this is not an image!", "not valid base64"),
    "non_ascii": ("iVBORw0KGgo\u00e9", "not valid base64"),
    "impossible_length": ("AAAAA", "not valid base64"),
    "mixed_alphabets": ("ab+_" * 8, "not valid base64"),
    "path": ("/tmp/a.png", "not valid base64"),
    "not_an_image": (_b64(b"hello world, these are bytes"), "is not an image"),
    "bmp": (_b64(_file(RGB, "BMP")), "BMP"),
    "gif": (_b64(_file(RGB, "GIF")), "GIF"),
    "animated_gif": (_b64(_frames("GIF", 3)), "GIF"),
    "tiff": (_b64(_file(RGB, "TIFF")), "TIFF"),
    "gif_media_type": ("data:image/gif;base64," + _b64(_file(RGB, "GIF")), "image/gif"),
    "text_media_type": ("data:text/plain;base64,aGVsbG8=", "text/plain"),
    "no_media_type": ("data:;base64," + _b64(PNG), "media type"),
    "data_url_not_base64": ("data:image/png,abc", "base64 data: URL"),
    "data_url_without_comma": ("data:image/png;base64", "base64 data: URL"),
    "png_declared_jpeg": ("data:image/jpeg;base64," + _b64(PNG), "declared image/jpeg but its bytes are a PNG"),
    "half_png": (_truncated(ACCEPTED["rgb_png"]), "truncated PNG"),
    "png_header_only": (_b64(ACCEPTED["rgb_png"][:20]), "truncated PNG"),
    "half_jpeg": (_truncated(ACCEPTED["rgb_jpeg"]), "truncated JPEG"),
    "jpeg_without_end": (_b64(ACCEPTED["rgb_jpeg"][:-2]), "truncated JPEG"),
    "half_progressive_jpeg": (_truncated(ACCEPTED["progressive_jpeg"]), "truncated JPEG"),
    "half_webp": (_truncated(ACCEPTED["lossless_webp"]), "truncated WEBP"),
    "one_pixel": (_b64(_file(Image.new("RGB", (1, 1)), "PNG")), f"at least {MIN_IMAGE_SIDE} pixels"),
    "thin": (_b64(_file(Image.new("RGB", (64, MIN_IMAGE_SIDE - 1)), "JPEG")), f"at least {MIN_IMAGE_SIDE} pixels"),
    "strip": (_b64(_file(Image.new("RGB", (33 * 16, 16)), "PNG")), "32 times the short one"),
    "apng": (_b64(_frames("PNG", 2)), "animated PNG (2 frames)"),
    "animated_webp": (_b64(_frames("WEBP", 3, lossless=True)), "animated WEBP (3 frames)"),
}


@pytest.mark.parametrize("field", ["image", "last_image"])
@pytest.mark.parametrize("value, message", REFUSED.values(), ids=REFUSED.keys())
def test_bad_images_are_field_errors(value, message, field):
    with pytest.raises(FieldError) as e:
        decode_image(value, field)
    assert e.value.field == field
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("value", [None, b"iVBORw0KGgo=", 3], ids=["none", "bytes", "int"])
def test_a_value_that_is_not_a_string(value):
    with pytest.raises(FieldError, match="must be a string"):
        decode_image(value, "last_image")


def test_limits_in_bytes_and_pixels():
    raw = ACCEPTED["rgb_png"]
    decode_image(_b64(raw), max_bytes=len(raw), max_pixels=40 * 56)
    with pytest.raises(FieldError, match=f"over the limit of {len(raw) - 1} bytes"):
        decode_image(_b64(raw), max_bytes=len(raw) - 1)
    with pytest.raises(FieldError, match=f"40: 2240 pixels, over the limit of {40 * 56 - 1}"):
        decode_image(_b64(raw), max_pixels=40 * 56 - 1)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@functools.cache
def _zero_png(side: int) -> bytes:
    """A complete 1-bit grayscale PNG of side x side zeros: a few dozen KB declaring side**2 pixels."""
    z = zlib.compressobj(9)
    row = bytes(1 + (side + 7) // 8)  # filter byte, then the packed pixels
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _jpeg_declaring(width: int, height: int) -> bytes:
    raw = bytearray(ACCEPTED["rgb_jpeg"])
    sof = raw.index(b"\xff\xc0")  # baseline frame header: length, precision, height, width
    raw[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(raw)


BOMBS = {
    "png_over_pillows_limit": _zero_png(20000),  # 400 M pixels: Pillow's DecompressionBombError
    "png_over_pillows_warning": _zero_png(10000),  # 100 M: Pillow warns, the limit refuses
    "png_under_pillows_warning": _zero_png(9000),  # 81 M: only the limit refuses
    "jpeg": _jpeg_declaring(60000, 60000),
}


@pytest.mark.parametrize("warnings_are_errors", [False, True], ids=["default_warnings", "warnings_as_errors"])
@pytest.mark.parametrize("raw", BOMBS.values(), ids=BOMBS.keys())
def test_a_decompression_bomb_is_refused_from_its_header(raw, warnings_are_errors, monkeypatch):
    assert len(raw) < 100_000
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda im: loads.append(im))
    value = _b64(raw)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error" if warnings_are_errors else "ignore", Image.DecompressionBombWarning)
            with pytest.raises(FieldError, match="pixels") as e:
                decode_image(value, "last_image")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.field == "last_image"
    assert not loads, "no pixel may be decoded"
    # The smallest bomb decodes to 81 M pixels (243 MB); the header alone costs the encoded value and a few
    # of Pillow's header tables.
    assert elapsed < 0.5 and peak < 1_000_000, (elapsed, peak)


def test_the_default_limit_stays_below_pillows_own():
    assert Image.MAX_IMAGE_PIXELS is not None and MAX_IMAGE_PIXELS < Image.MAX_IMAGE_PIXELS


def test_truncated_files_cannot_pass_if_pillow_is_told_to_load_them(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_image(_b64(ACCEPTED["rgb_png"]))


@pytest.mark.parametrize("raw", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_worker_rebuilds_the_same_image(raw):
    pixels = decode_image(_b64(raw))
    for wire in (pixels, torch.from_numpy(pixels.copy())):
        im = image_from_array(wire)
        assert im.mode == "RGB" and im.size == (pixels.shape[1], pixels.shape[0])
        assert np.array_equal(np.asarray(im), pixels)
        assert np.array_equal(np.asarray(im), np.asarray(load_image(Image.open(io.BytesIO(raw)))))


@pytest.mark.parametrize("bad", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                                 np.zeros((4, 4, 4), np.uint8), np.zeros((0, 4, 3), np.uint8)],
                         ids=["float", "gray", "rgba", "empty"])
def test_only_rgb_uint8_pixels_are_an_image(bad):
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        image_from_array(bad)
    with pytest.raises(ValueError):
        image_digest(bad)


def test_the_digest_names_the_pixels():
    a = decode_image(_b64(ACCEPTED["rgb_png"]))
    same = decode_image("data:image/webp;base64," + _b64(ACCEPTED["lossless_webp"]))
    assert image_digest(a) == image_digest(same) == image_digest(torch.from_numpy(a.copy()))
    assert image_digest(a) == image_digest(np.asfortranarray(a))
    other = a.copy()
    other[0, 0, 0] ^= 1
    assert image_digest(other) != image_digest(a)
    flat = np.zeros((16, 64, 3), np.uint8)
    assert image_digest(flat) != image_digest(flat.reshape(64, 16, 3)) != image_digest(flat.reshape(32, 32, 3))
    assert len(image_digest(a)) == 64

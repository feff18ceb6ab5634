"""A request's conditioning image (``image``, ``last_image``) to validated RGB pixels.

The value is the image file's bytes as base64 (standard or urlsafe, padding and whitespace optional) or as a
``data:image/png|jpeg|jpg|webp;base64,...`` URL; the engine fetches nothing. PNG, JPEG and WEBP are decoded
(the format read from the bytes, which must agree with a data: URL's media type); anything else, animated
images, truncated files and sizes outside the limits below are a :class:`FieldError` naming the field (a 400).
The pixels are exactly ``numpy.asarray(diffusers.utils.load_image(Image.open(io.BytesIO(raw))))``: EXIF
orientation applied, then ``.convert("RGB")``. They travel as uint8 ``[H, W, 3]``; a worker rebuilds the PIL
image with :func:`common.protocol.images.image_from_array`.

Decoding a large image takes a while and releases the GIL: call :func:`decode_image` off the event loop.
"""

from __future__ import annotations

import base64
import io
import re

import numpy as np
from PIL import Image, ImageFile, ImageOps

from router.core.errors import FieldError

# The encoded file (its base64 is a third longer): room for a high-quality JPEG of MAX_IMAGE_PIXELS.
MAX_IMAGE_BYTES = 32 << 20
# 8192 x 8192: larger than any camera's frame a model is conditioned on, and below Pillow's own
# decompression-bomb threshold (Image.MAX_IMAGE_PIXELS, ~89.5 M), so Pillow never warns about an accepted image.
MAX_IMAGE_PIXELS = 8192 * 8192
# Wan's VAE downsamples 8x and its transformer patches 2x2 latents: 16 pixels is one patch, the least a
# conditioning image can say; anything smaller (a 1x1 placeholder) is a mistake, not a picture.
MIN_IMAGE_SIDE = 16
# Image processors resize the short side to a fixed size (CLIP: 224) and keep the aspect ratio, so a 16 x 4M
# strip within MAX_IMAGE_PIXELS would grow to 224 x 56M pixels on the encoder worker. No video frame is
# anywhere near 32:1.
MAX_ASPECT_RATIO = 32

# The media types a data: URL may declare, by the format Pillow must then find in the bytes.
_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_OPENERS = ("PNG", "JPEG", "WEBP")  # the only Pillow plugins that ever parse a request's bytes
_ACCEPTED = "accepted formats: PNG, JPEG, WEBP (one still image)"
_HOW = "send the image's bytes as base64 or a data: URL"
# First bytes of files people send by mistake, to name them in the refusal (Pillow never parses them here).
_SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF8": "GIF", b"BM": "BMP",
               b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"%PDF": "PDF", b"<svg": "SVG", b"<?xml": "XML"}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # base64 has no ':', so this is a URL
_SPACE = re.compile(r"\s+")
_URLSAFE = str.maketrans("-_", "+/")


def _payload(text: str, field: str) -> tuple[str | None, str]:
    """(the media type a data: URL declares, or None for bare base64; the base64 text)."""
    scheme = _SCHEME.match(text)
    if scheme is None:
        return None, text
    if scheme.group().lower() != "data:":
        raise FieldError(field, f"is a URL ({scheme.group()}): the engine fetches nothing: {_HOW}")
    header, comma, data = text[len("data:"):].partition(",")
    params = [p.strip().lower() for p in header.split(";")]
    if not comma or params[-1] != "base64":
        raise FieldError(field, "must be a base64 data: URL, data:image/png;base64,<data>")
    if params[0] not in _MEDIA_TYPES:
        raise FieldError(field, f"declares media type {params[0] or '(none)'!r}: accepted: {', '.join(_MEDIA_TYPES)}")
    return params[0], data


def _bytes(data: str, field: str, max_bytes: int) -> bytes:
    data = _SPACE.sub("", data).rstrip("=")
    if len(data) * 3 // 4 > max_bytes:  # before decoding: n base64 characters hold 3n/4 bytes
        raise FieldError(field, f"is over the limit of {max_bytes} bytes (encoded image file)")
    if ("-" in data or "_" in data) and not ("+" in data or "/" in data):
        data = data.translate(_URLSAFE)
    try:
        if len(data) % 4 == 1:  # no number of bytes encodes to this length
            raise ValueError
        raw = base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        raise FieldError(field, f"is not valid base64 (nor a data: URL): {_HOW}") from None
    if not raw:
        raise FieldError(field, f"is empty (zero bytes): {_HOW}")
    return raw


def _unreadable(raw: bytes) -> str:
    """Why Pillow's PNG, JPEG and WEBP openers all refused ``raw``."""
    found = next((name for sig, name in _SIGNATURES.items() if raw.startswith(sig)), None)
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        found = "WEBP"
    if found in _OPENERS:
        return f"is a damaged or truncated {found} file"
    return f"is a {found} file: {_ACCEPTED}" if found else f"is not an image: {_ACCEPTED}"


def _check_size(im: Image.Image, field: str, max_pixels: int) -> None:
    """The size from the header, before a pixel is decoded."""
    w, h = im.size
    if w * h > max_pixels:
        raise FieldError(field, f"is {w}x{h}: {w * h} pixels, over the limit of {max_pixels}")
    if min(w, h) < MIN_IMAGE_SIDE:
        raise FieldError(field, f"is {w}x{h}: each side must be at least {MIN_IMAGE_SIDE} pixels")
    if max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        raise FieldError(field, f"is {w}x{h}: the long side may be at most {MAX_ASPECT_RATIO} times the short one")


def decode_image(value: str, field: str = "image", *, max_pixels: int = MAX_IMAGE_PIXELS,
                 max_bytes: int = MAX_IMAGE_BYTES) -> np.ndarray:
    """The RGB pixels (uint8 ``[H, W, 3]``, C-contiguous) of a request's image; a bad one raises
    :class:`FieldError` naming ``field``."""
    if not isinstance(value, str):
        raise FieldError(field, f"must be a string: {_HOW}")
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # global: a truncated file would decode with its missing part gray
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is on in this process: request images "
                           "cannot be checked for truncation")
    declared, data = _payload(value.strip(), field)
    raw = _bytes(data, field, max_bytes)
    try:
        # Reads the header only. Pillow refuses above 2 * Image.MAX_IMAGE_PIXELS itself (the error), and warns
        # above it: a warning made an error by the process's filters is the same refusal.
        im = Image.open(io.BytesIO(raw), formats=_OPENERS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise FieldError(field, f"declares more pixels than the limit of {max_pixels}") from None
    except MemoryError:
        raise
    except Exception:  # UnidentifiedImageError, or an opener's own error on a damaged header
        raise FieldError(field, _unreadable(raw)) from None
    with im:
        fmt = "JPEG" if im.format == "MPO" else im.format  # MPO: a JPEG plus more pictures; load_image takes the first
        if declared is not None and _MEDIA_TYPES[declared] != fmt:
            raise FieldError(field, f"is declared {declared} but its bytes are a {fmt} image")
        _check_size(im, field, max_pixels)
        if fmt != "JPEG" and getattr(im, "n_frames", 1) > 1:
            raise FieldError(field, f"is an animated {fmt} ({im.n_frames} frames): send one still image")
        try:
            im.load()  # the whole decode: a truncated or corrupt file fails here, not later on a worker
            rgb = ImageOps.exif_transpose(im).convert("RGB")  # diffusers.utils.load_image's two steps
        except MemoryError:
            raise
        except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, EOFError... on bad data
            raise FieldError(field, f"is a damaged or truncated {fmt} file ({str(e)[:200]})") from None
    return np.array(rgb, dtype=np.uint8, order="C")

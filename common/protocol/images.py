"""Conditioning images on the wire: RGB pixels as a uint8 array ``[H, W, 3]``, never an encoded file or a
pickled PIL object. The router decodes a request's image (``router.request.images.decode_image``); a worker rebuilds
the PIL image the model's processors take with :func:`image_from_array`."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Union

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

Pixels = Union[np.ndarray, "torch.Tensor"]


def _rgb_pixels(a: Pixels) -> np.ndarray:
    """``a`` (a numpy array or a CPU tensor) as a C-contiguous uint8 ``[H, W, 3]`` array; anything else raises."""
    arr = np.asarray(a)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3 or 0 in arr.shape:
        raise ValueError(f"an image must be uint8 [H, W, 3] RGB pixels, got {arr.dtype}{list(arr.shape)}")
    return np.ascontiguousarray(arr)


def image_from_array(a: Pixels) -> Image.Image:
    """The RGB PIL image whose pixels are ``a``: what ``diffusers.utils.load_image`` gave for the request's bytes."""
    return Image.fromarray(_rgb_pixels(a))  # uint8 [H, W, 3] is mode RGB


def image_digest(a: Pixels) -> str:
    """sha256 of the shape and the pixels: equal for equal images, a cache key for what is computed from one."""
    arr = _rgb_pixels(a)
    h = hashlib.sha256(("rgb8:%dx%d:" % arr.shape[:2]).encode())
    h.update(memoryview(arr).cast("B"))
    return h.hexdigest()

"""Frames out as files people can open: PNG (Pillow) for one frame, MP4 (H.264, yuv420p; PyAV) for a video.

Frames arrive from the decode worker as float32 [F, H, W, 3] in [0, 1] per
sample; each value becomes ``round(255 * x)``. PyAV's wheels carry FFmpeg
(libx264 included): no system ffmpeg is needed.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import torch

PNG, MP4 = "image/png", "video/mp4"
MEDIA_TYPES = {"png": PNG, "mp4": MP4}
# H.264 quality: constant rate factor 12 (0 lossless, 23 libx264's default). Random-weight models give noisy
# frames, which lower settings would smear; 12 keeps even those above 30 dB PSNR.
MP4_CRF = 12


def to_uint8(frames: torch.Tensor) -> np.ndarray:
    """float frames [F, H, W, 3] in [0, 1] -> uint8 [F, H, W, 3]."""
    return (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()


def frame_size(frames: torch.Tensor) -> str:
    """``WIDTHxHEIGHT`` of frames [F, H, W, 3]: the size a model made, which may differ from the one asked
    (FLUX.1 Kontext makes its ``max_area`` at the asked aspect)."""
    return f"{frames.shape[-2]}x{frames.shape[-3]}"


def png_bytes(frames: torch.Tensor) -> bytes:
    """The one frame of ``frames`` [1, H, W, 3] as a PNG."""
    from PIL import Image

    if frames.shape[0] != 1:
        raise ValueError(f"a PNG holds one frame, got {frames.shape[0]}")
    out = io.BytesIO()
    Image.fromarray(to_uint8(frames)[0], mode="RGB").save(out, format="PNG")
    return out.getvalue()


def mp4_bytes(frames: torch.Tensor, fps: int) -> bytes:
    """``frames`` [F, H, W, 3] as an H.264 MP4 (yuv420p, ``fps`` frames per second), in memory."""
    import av

    pixels = to_uint8(frames)
    _, height, width, _ = pixels.shape
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(MP4_CRF), "preset": "medium"}
        for picture in pixels:
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder
            container.mux(packet)
    return out.getvalue()


def encode(frames: torch.Tensor, kind: str, fps: int) -> bytes:
    """One sample's frames as ``kind`` (``png`` or ``mp4``)."""
    return png_bytes(frames) if kind == "png" else mp4_bytes(frames, fps)


def decode_mp4(data: bytes) -> np.ndarray:
    """An MP4's frames as uint8 [F, H, W, 3] (for tests and clients)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

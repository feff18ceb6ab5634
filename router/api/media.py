"""Frames out as files people can open: PNG (Pillow) for one frame, MP4 (H.264, yuv420p; PyAV) for a video,
with the model's sound as its audio track where the model makes sound (router/api/sound.py), and WAV for the
sound alone.

Frames arrive from the decode worker as float32 [F, H, W, 3] in [0, 1] per
sample; each value becomes ``round(255 * x)``. PyAV's wheels carry FFmpeg
(libx264 included): no system ffmpeg is needed.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import torch

from common.protocol.messages import AUDIO
from router.api.sound import WAV, AudioTrack, Sound, wav_bytes

PNG, MP4 = "image/png", "video/mp4"
MEDIA_TYPES = {"png": PNG, "mp4": MP4, "wav": WAV}
SOUND_ONLY = "wav"  # the one file that holds the sound alone
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


def file_types(makes_sound: bool) -> dict[str, str]:
    """The files (output_type -> media type) a model's answers may be: wav only from a model that makes sound."""
    return {kind: t for kind, t in MEDIA_TYPES.items() if makes_sound or kind != SOUND_ONLY}


def video_rate(fps: float) -> Fraction:
    """A frame rate as the MP4's exact rate: an integer as it is, 23.976 as 2997/125, 30000/1001's float as
    30000/1001 (a time base must stay small)."""
    return Fraction(fps).limit_denominator(1001)


def video_fps(params, info) -> float:
    """The frame rate a request's video plays at (``info``: the model's ModelInfo): the request's own where its
    family takes one as a field (the binding's ``request_fps``), else the model's."""
    from_request = info.family.request_fps
    return info.fps if from_request is None else from_request(params)


def sound_of(sample) -> Sound | None:
    """One sample's (:meth:`Outcome.sample`) waveform at its vocoder's rate; None from a model without sound."""
    wave = sample.tensors.get(AUDIO.name)
    return None if wave is None else Sound(wave, int(sample.info["audio_sample_rate"]))


def mp4_bytes(frames: torch.Tensor, fps: float, sound: Sound | None = None) -> bytes:
    """``frames`` [F, H, W, 3] as an H.264 MP4 (yuv420p, ``fps`` frames per second), in memory; ``sound``: an
    audio track beside it (stream 1), from the first frame on."""
    import av

    pixels = to_uint8(frames)
    _, height, width, _ = pixels.shape
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=video_rate(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(MP4_CRF), "preset": "medium"}
        track = None if sound is None else AudioTrack(container, sound)
        for i, picture in enumerate(pixels):
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
            if track is not None:  # the sound up to this frame's end: the two streams interleave
                track.feed_until((i + 1) / fps)
        for packet in stream.encode():  # flush the encoder
            container.mux(packet)
        if track is not None:
            track.finish()
    return out.getvalue()


def encode(frames: torch.Tensor, kind: str, fps: float, sound: Sound | None = None) -> bytes:
    """One sample's frames (and ``sound``) as ``kind`` (``png``, ``mp4`` or ``wav``: the sound alone)."""
    if kind == SOUND_ONLY:
        return wav_bytes(sound)
    return png_bytes(frames) if kind == "png" else mp4_bytes(frames, fps, sound)


def decode_mp4(data: bytes) -> np.ndarray:
    """An MP4's frames as uint8 [F, H, W, 3] (for tests and clients)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

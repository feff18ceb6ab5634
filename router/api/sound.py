"""A model's waveform as files: an audio track muxed into an MP4 beside the video (AAC, else Opus; PyAV), or a
WAV of its own (16-bit PCM; the standard library's ``wave``).

The waveform arrives from the decode worker as float32 [channels, samples] per sample at the vocoder's output
rate (``Result.info["audio_sample_rate"]``); values outside [-1, 1] are clipped, as a player would.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

WAV = "audio/wav"
# The first of these that this PyAV build can encode writes an MP4's audio track.
MP4_AUDIO_CODECS = ("aac", "libopus")
# Per channel: 96 kb/s keeps FFmpeg's AAC encoder transparent enough for speech and music at 24-48 kHz.
BIT_RATE_PER_CHANNEL = 96_000
LAYOUTS = {1: "mono", 2: "stereo"}
PCM_MAX = 32767  # 16-bit PCM full scale


@dataclass(frozen=True)
class Sound:
    """One sample's waveform: float [channels, samples], ``rate`` samples per second."""

    wave: torch.Tensor
    rate: int

    def pcm(self) -> np.ndarray:
        """float32 [channels, samples] in [-1, 1], C-order."""
        return np.ascontiguousarray(self.wave.detach().float().clamp(-1, 1).cpu().numpy())


def mp4_audio_codec() -> str:
    """The codec an MP4's audio track is written with: AAC where this PyAV build has an encoder, else Opus."""
    import av

    for name in MP4_AUDIO_CODECS:
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # not in this build
            continue
    raise RuntimeError(f"this PyAV build encodes none of {', '.join(MP4_AUDIO_CODECS)}")


class AudioTrack:
    """An audio stream of an open MP4 container, fed as the video advances so the two interleave; its first
    sample at time 0, as the video's first frame."""

    def __init__(self, container, sound: Sound, codec: str | None = None):
        channels = sound.wave.shape[0]
        if channels not in LAYOUTS:
            raise ValueError(f"an MP4 audio track takes {' or '.join(map(str, LAYOUTS))} channels, got {channels}")
        self.container, self.pcm, self.rate = container, sound.pcm(), int(sound.rate)
        self.layout = LAYOUTS[channels]
        self.stream = container.add_stream(codec or mp4_audio_codec(), rate=self.rate, layout=self.layout)
        self.stream.bit_rate = BIT_RATE_PER_CHANNEL * channels
        self.fed = 0

    def feed_until(self, seconds: float) -> None:
        """Encode the waveform up to ``seconds`` (the end of the video frame just muxed)."""
        self._encode(min(self.pcm.shape[1], round(seconds * self.rate)))

    def finish(self) -> None:
        """Encode the rest of the waveform and flush the encoder."""
        self._encode(self.pcm.shape[1])
        for packet in self.stream.encode(None):
            self.container.mux(packet)

    def _encode(self, stop: int) -> None:
        import av

        if stop <= self.fed:
            return
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(self.pcm[:, self.fed:stop]), format="fltp",
                                           layout=self.layout)
        frame.sample_rate, frame.pts, frame.time_base = self.rate, self.fed, Fraction(1, self.rate)
        for packet in self.stream.encode(frame):  # PyAV cuts it into the codec's frame size
            self.container.mux(packet)
        self.fed = stop


def wav_bytes(sound: Sound) -> bytes:
    """The waveform as a WAV: 16-bit PCM, ``round(32767 * x)`` of the clipped samples, channels interleaved."""
    pcm = sound.pcm()
    ints = np.round(pcm.T * PCM_MAX).astype("<i2")  # [samples, channels]: WAV's interleaved order
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(pcm.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sound.rate))
        w.writeframes(ints.tobytes())
    return out.getvalue()


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A 16-bit WAV's samples as float32 [channels, samples] in [-1, 1], and its rate (for tests and clients)."""
    with wave.open(io.BytesIO(data), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"expected 16-bit PCM, got {8 * w.getsampwidth()}-bit")
        ints = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
        return (ints.T.astype(np.float32) / PCM_MAX), w.getframerate()


def decode_mp4_audio(data: bytes) -> tuple[np.ndarray, int, float]:
    """An MP4's audio track as a player plays it (for tests and clients): float32 [channels, samples] from time
    0 on (what a codec decodes before 0, Opus's pre-skip, is dropped), the decoded rate (Opus: always 48 kHz),
    and the first sample's time in seconds."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = list(container.decode(container.streams.audio[0]))
    start = float(frames[0].pts * frames[0].time_base)
    rate = frames[0].sample_rate
    pcm = np.concatenate([_planar(f) for f in frames], axis=1)
    early = round(-start * rate) if start < 0 else 0
    return pcm[:, early:].astype(np.float32), rate, max(start, 0.0)


def _planar(frame) -> np.ndarray:
    """A decoded float audio frame as [channels, samples] (packed formats interleave the channels)."""
    data = frame.to_ndarray()
    return data if frame.format.is_planar else data.reshape(-1, len(frame.layout.channels)).T

"""LTX-2's two latent streams and how they sit in one tensor.

The pipeline denoises video latents (packed ``[S_v, C]`` tokens, :meth:`LTX2Pipeline._pack_latents`) and audio
latents (``[S_a, C]``, :meth:`LTX2Pipeline._pack_audio_latents`: latent frames by channels x mel bins) jointly,
on one sigma schedule. The engine carries them as one tensor per sample, ``[S_v + S_a, C]``, video tokens first:
every shared mechanism (rows, the SDE step, groups, trajectories, resumes) then handles both streams at once,
and the family's parts split it where the streams differ. Both streams have the same token width in LTX-2
(``in_channels == audio_in_channels``); a directory where they differ is refused when it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

STREAMS = ("video", "audio")


@lru_cache(maxsize=32)
def _config(path: Path, component: str) -> dict:
    return json.loads((path / component / "config.json").read_text())


def video_compression(path: Path) -> tuple[int, int]:
    """(spatial, temporal) pixels per latent of ``vae/``, as ``AutoencoderKLLTX2Video`` computes them."""
    c = _config(path, "vae")
    scaled = sum(c.get("spatio_temporal_scaling", (True, True, True, True)))
    spatial = c.get("spatial_compression_ratio") or c.get("patch_size", 4) * 2 ** scaled
    temporal = c.get("temporal_compression_ratio") or c.get("patch_size_t", 1) * 2 ** scaled
    return int(spatial), int(temporal)


AUDIO_DOWNSAMPLE = 4  # AutoencoderKLLTX2Audio's temporal and mel compression (a constant of the class)


@dataclass(frozen=True)
class Ltx2Geometry:
    latent_frames: int
    latent_height: int
    latent_width: int
    patch_size: int
    patch_size_t: int
    channels: int  # the token width of both streams
    audio_frames: int  # audio latent frames (= audio tokens)
    audio_latent_channels: int
    latent_mel_bins: int

    @classmethod
    def of(cls, path: Path, height: int, width: int, num_frames: int, frame_rate: float) -> "Ltx2Geometry":
        """The streams of a request of ``height`` x ``width``, ``num_frames`` at ``frame_rate``, as the
        pipeline sizes them (``audio_num_frames = round(duration * latents per second)``)."""
        path = Path(path)
        t, a = _config(path, "transformer"), _config(path, "audio_vae")
        spatial, temporal = video_compression(path)
        mel_bins = a.get("mel_bins", 64) // AUDIO_DOWNSAMPLE
        per_second = a.get("sample_rate", 16000) / a.get("mel_hop_length", 160) / float(AUDIO_DOWNSAMPLE)
        return cls(latent_frames=(num_frames - 1) // temporal + 1, latent_height=height // spatial,
                   latent_width=width // spatial, patch_size=t.get("patch_size", 1),
                   patch_size_t=t.get("patch_size_t", 1), channels=t.get("in_channels", 128),
                   audio_frames=round(num_frames / frame_rate * per_second),
                   audio_latent_channels=a.get("latent_channels", 8), latent_mel_bins=mel_bins)

    @property
    def video_tokens(self) -> int:
        return (self.latent_frames // self.patch_size_t) * (self.latent_height // self.patch_size) * (
            self.latent_width // self.patch_size)

    @property
    def audio_tokens(self) -> int:
        return self.audio_frames

    @property
    def tokens(self) -> int:
        return self.video_tokens + self.audio_tokens

    @property
    def video_shape(self) -> tuple[int, ...]:
        """The unpacked video latents' per-sample shape [C_latent, F', H', W'] (the pipeline's noise shape)."""
        c = self.channels // (self.patch_size_t * self.patch_size ** 2)
        return (c, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def audio_shape(self) -> tuple[int, ...]:
        """The unpacked audio latents' per-sample shape [C_audio, L, M']."""
        return (self.audio_latent_channels, self.audio_frames, self.latent_mel_bins)

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., S_v + S_a, C] -> (video [..., S_v, C], audio [..., S_a, C]) (views)."""
        return joint[..., :self.video_tokens, :], joint[..., self.video_tokens:, :]

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([video, audio], dim=-2)

    def stream_masks(self, device=None) -> dict[str, torch.Tensor]:
        """Per stream, which of the joint tensor's elements are its own: bool [S_v + S_a, C]."""
        tokens = torch.arange(self.tokens, device=device)[:, None].expand(self.tokens, self.channels)
        return {"video": tokens < self.video_tokens, "audio": tokens >= self.video_tokens}

    def pack_video(self, latents: torch.Tensor) -> torch.Tensor:
        """[n, C, F', H', W'] -> [n, S_v, C * p_t * p * p], as ``LTX2Pipeline._pack_latents``."""
        from diffusers import LTX2Pipeline

        return LTX2Pipeline._pack_latents(latents, self.patch_size, self.patch_size_t)

    def unpack_video(self, tokens: torch.Tensor) -> torch.Tensor:
        from diffusers import LTX2Pipeline

        return LTX2Pipeline._unpack_latents(tokens, self.latent_frames, self.latent_height, self.latent_width,
                                            self.patch_size, self.patch_size_t)

    @staticmethod
    def pack_audio(latents: torch.Tensor) -> torch.Tensor:
        """[n, C, L, M'] -> [n, L, C * M'], as ``LTX2Pipeline._pack_audio_latents``."""
        from diffusers import LTX2Pipeline

        return LTX2Pipeline._pack_audio_latents(latents)

    def unpack_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        from diffusers import LTX2Pipeline

        return LTX2Pipeline._unpack_audio_latents(tokens, self.audio_frames, num_mel_bins=self.latent_mel_bins)

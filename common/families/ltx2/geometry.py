"""LTX-2's two latent streams and how they sit in one tensor.

The pipeline denoises video latents (packed ``[S_v, C]`` tokens, :meth:`LTX2Pipeline._pack_latents`) and audio
latents (``[S_a, C]``, :meth:`LTX2Pipeline._pack_audio_latents`: latent frames by channels x mel bins) jointly,
on one sigma schedule. The engine carries them as one tensor per sample, ``[S_v + S_a, C]``, video tokens first:
every shared mechanism (rows, the SDE step, groups, trajectories, resumes) then handles both streams at once,
and the family's parts split it where the streams differ.

The streams' token widths are the transformer's ``in_channels`` and ``audio_in_channels`` (the audio VAE's
latent channels x mel bins / 4). LTX-2's checkpoints have them equal; where they differ, ``C`` is the wider
one and the narrower stream's tokens are zero-padded to it. The padding belongs to no stream
(:meth:`Ltx2Geometry.stream_masks`): :meth:`~Ltx2Geometry.split` drops it (the model, the guidance and the
decoders see each stream in the pipeline's own shape), :meth:`~Ltx2Geometry.join` puts zeros back (the model's
velocity there is 0, so every step leaves it 0), and an SDE step treats it as an element on its ODE: no noise
kept, no part in a log-prob, a KL or a mean (common/diffusion/streams.py).
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


def audio_token_width(path: Path) -> int:
    """The width of the audio tokens ``LTX2Pipeline`` packs: ``audio_vae/``'s latent channels x mel bins / 4."""
    a = _config(Path(path), "audio_vae")
    return int(a.get("latent_channels", 8)) * (int(a.get("mel_bins", 64)) // AUDIO_DOWNSAMPLE)


@dataclass(frozen=True)
class Ltx2Geometry:
    latent_frames: int
    latent_height: int
    latent_width: int
    patch_size: int
    patch_size_t: int
    channels: int  # the video tokens' width (the transformer's in_channels)
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
    def audio_channels(self) -> int:
        """The audio tokens' width: latent channels x latent mel bins (the transformer's audio_in_channels)."""
        return self.audio_latent_channels * self.latent_mel_bins

    @property
    def width(self) -> int:
        """The joint tensor's last dimension: the wider stream's token width."""
        return max(self.channels, self.audio_channels)

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
        """[..., S_v + S_a, C] -> (video [..., S_v, C_v], audio [..., S_a, C_a]) (views, without the padding)."""
        return joint[..., :self.video_tokens, :self.channels], joint[..., self.video_tokens:, :self.audio_channels]

    def join(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`: the narrower stream's tokens zero-padded to :attr:`width`."""
        def padded(x):
            return x if x.shape[-1] == self.width else torch.nn.functional.pad(x, (0, self.width - x.shape[-1]))
        return torch.cat([padded(video), padded(audio)], dim=-2)

    def stream_masks(self, device=None) -> dict[str, torch.Tensor]:
        """Per stream, which of the joint tensor's elements are its own: bool [S_v + S_a, C] (the padding of the
        narrower stream is in neither)."""
        tokens = torch.arange(self.tokens, device=device)[:, None]
        lanes = torch.arange(self.width, device=device)[None, :]
        return {"video": (tokens < self.video_tokens) & (lanes < self.channels),
                "audio": (tokens >= self.video_tokens) & (lanes < self.audio_channels)}

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

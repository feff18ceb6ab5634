"""LTX-2's decode side: the joint latents ``[n, S_v + S_a, C]`` of requests to frames and a waveform, as the
end of ``LTX2Pipeline.__call__`` makes them.

Video: the tokens unpacked, mixed with decode noise at ``decode_noise_scale`` when the VAE is timestep
conditioned (``decode_timestep`` then goes to the VAE), de-normalised, ``AutoencoderKLLTX2Video.decode``, frames
in [0, 1] as ``VideoProcessor.postprocess_video`` makes them. Audio: the tokens de-normalised (on the packed
tokens, as the pipeline), unpacked, ``AutoencoderKLLTX2Audio.decode`` to a mel spectrogram, the vocoder to the
waveform. The de-normalisations are diffusers' own static helpers (``LTX2Pipeline._denormalize_latents``,
``_denormalize_audio_latents``).

The decode noise is what the pipeline's one generator draws for one prompt after the initial noise: sample i
of a request replays its generator (``seed + i``: video noise, then audio noise, the shapes the latents part
draws) and then draws noise of the video latents' shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from common.diffusion.parts.decoder import Decoded
from common.diffusion.request_fields import field_value
from common.diffusion.vae_tiling import VaeTiling
from common.families.ltx2.fields import DECODE_NOISE_SCALE, DECODE_TIMESTEP, DEFAULTS, frame_rate
from common.families.ltx2.geometry import Ltx2Geometry
from common.diffusion.loading import load_component

if TYPE_CHECKING:
    from common.diffusion.model_info import ModelInfo
    from common.protocol.messages import GenerationParams

def video_frames(video: torch.Tensor) -> torch.Tensor:
    """VAE output [n, 3, F, H, W] in [-1, 1] -> float32 frames [n, F, H, W, 3] in [0, 1]."""
    # VideoProcessor's order: de-normalise and clamp in the VAE's dtype, then widen.
    return (video / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).contiguous()


@dataclass(frozen=True)
class DecodeSettings:
    """One sample's decode inputs, read off its request."""

    seed: int
    timestep: float
    noise_scale: float

    @classmethod
    def of(cls, params: "GenerationParams", index: int) -> "DecodeSettings":
        timestep = field_value(params, DECODE_TIMESTEP.name)
        timestep = float(DEFAULTS["decode_timestep"] if timestep is None else timestep)
        noise_scale = field_value(params, DECODE_NOISE_SCALE.name)
        return cls(params.sample_seed(index), timestep, timestep if noise_scale is None else float(noise_scale))


def vocoder_class(path: Path):
    """The directory's vocoder class: ``LTX2Vocoder`` (LTX-2), ``LTX2VocoderWithBWE`` (LTX-2.3: a bandwidth
    extension to a higher output rate)."""
    from diffusers.pipelines.ltx2 import vocoder

    name = json.loads((Path(path) / "vocoder" / "config.json").read_text()).get("_class_name", "LTX2Vocoder")
    if name not in ("LTX2Vocoder", "LTX2VocoderWithBWE"):
        raise ValueError(f"vocoder/config.json: {name!r} is not an LTX-2 vocoder")
    return getattr(vocoder, name)


class Ltx2Decoder:
    def __init__(self, path: Path, vae, audio_vae, vocoder, device, tiling: VaeTiling = VaeTiling()):
        self.path, self.device, self.tiling = Path(path), device, tiling
        self.vae, self.audio_vae, self.vocoder = vae, audio_vae, vocoder
        self.sample_rate = int(vocoder.config.output_sampling_rate)  # the waveform's, not the mel's rate

    @classmethod
    def load(cls, info: "ModelInfo", dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> "Ltx2Decoder":
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video

        def ready(m):
            return m.to(device).eval().requires_grad_(False)

        return cls(info.path, ready(load_component(AutoencoderKLLTX2Video, info.path / "vae", dtype)),
                   ready(load_component(AutoencoderKLLTX2Audio, info.path / "audio_vae", dtype)),
                   ready(load_component(vocoder_class(info.path), info.path / "vocoder", dtype)), device,
                   tiling)

    def batch_key(self, params: "GenerationParams") -> Ltx2Geometry:
        """Requests decode together when their streams have the same shapes: the joint latents' shape alone
        does not say (other frame counts and rates can share a token count)."""
        return self.geometry(params, params.height, params.width)

    def geometry(self, params: "GenerationParams", height: int, width: int) -> Ltx2Geometry:
        return Ltx2Geometry.of(self.path, height, width, params.num_frames, frame_rate(params))

    @torch.no_grad()
    def decode_rows(self, latents: torch.Tensor, rows: Sequence[tuple["GenerationParams", int]], height: int,
                    width: int) -> Decoded:
        """Joint latents [n, S_v + S_a, C], row k sample ``rows[k][1]`` of request ``rows[k][0]`` (all of one
        :meth:`batch_key` and size) -> frames [n, F, H, W, 3] and the waveform [n, channels, samples]."""
        geo = self.geometry(rows[0][0], height, width)
        if any(self.geometry(p, height, width) != geo for p in {id(p): p for p, _ in rows}.values()):
            raise ValueError("rows of one LTX-2 decode call must have streams of the same shapes")
        settings = [DecodeSettings.of(p, i) for p, i in rows]
        video, audio = geo.split(latents.to(self.device, torch.float32))
        frames = self.decode_video(geo.unpack_video(video), settings, geo, rows[0][0].num_frames)
        return Decoded(frames, self.decode_audio(audio, geo), self.sample_rate)

    def decode_noise(self, settings: Sequence[DecodeSettings], geo: Ltx2Geometry) -> torch.Tensor:
        """[n, *video_shape]: each sample's generator past its initial draws, then the decode draw (float32)."""
        out = []
        for s in settings:
            g = torch.Generator("cpu").manual_seed(s.seed)
            torch.randn((1, *geo.video_shape), generator=g)  # the initial video noise
            torch.randn((1, *geo.audio_shape), generator=g)  # the initial audio noise
            out.append(torch.randn((1, *geo.video_shape), generator=g))
        return torch.cat(out)

    def decode_video(self, latents: torch.Tensor, settings: Sequence[DecodeSettings], geo: Ltx2Geometry,
                     num_frames: int) -> torch.Tensor:
        from diffusers import LTX2Pipeline

        vae, dtype = self.vae, self.vae.dtype
        latents = latents.to(dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            noise = self.decode_noise(settings, geo).to(self.device, dtype)
            timestep = torch.tensor([s.timestep for s in settings], device=self.device, dtype=dtype)
            scale = torch.tensor([s.noise_scale for s in settings], device=self.device, dtype=dtype)
            scale = scale.view(-1, 1, 1, 1, 1)
            latents = (1 - scale) * latents + scale * noise
        latents = LTX2Pipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std,
                                                   vae.config.scaling_factor)
        spatial = vae.spatial_compression_ratio
        self.tiling.apply(vae, num_frames, geo.latent_height * spatial, geo.latent_width * spatial)
        return video_frames(vae.decode(latents, timestep, return_dict=False)[0])

    def decode_audio(self, tokens: torch.Tensor, geo: Ltx2Geometry) -> torch.Tensor:
        from diffusers import LTX2Pipeline

        # De-normalised on the packed tokens in float32, then unpacked: the pipeline's order.
        tokens = LTX2Pipeline._denormalize_audio_latents(tokens, self.audio_vae.latents_mean,
                                                         self.audio_vae.latents_std)
        latents = geo.unpack_audio(tokens).to(self.audio_vae.dtype)
        mel = self.audio_vae.decode(latents, return_dict=False)[0]
        return self.vocoder(mel).float()

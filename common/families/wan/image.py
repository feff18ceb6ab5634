"""Wan image-to-video's image side, run by the encoder worker (and by a trainer's recompute).

From one request image (and, on first-last-frame models, a last image) it makes what the denoise worker
needs, as ``WanImageToVideoPipeline`` makes it:

- ``image_embeds`` [k, 257, D]: the CLIP vision encoder's second-to-last hidden state of each image (Wan2.1
  I2V; models whose transformer has ``image_dim``), from the image as given (the CLIP processor resizes);
- ``image_condition``: the VAE encoding (``argmax``: the posterior's mode) of the image resized to the
  request's size, normalised by ``latents_mean`` / ``latents_std``:
  - concatenated models (Wan2.1 I2V, Wan2.2 I2V-A14B): the video ``[image, zeros...]`` (or ``[image, zeros...,
    last_image]``) encoded, with the 4-channel first-frame mask in front: ``[4 + C, F', H', W']``;
  - ``expand_timesteps`` models (Wan2.2 TI2V-5B): the image alone, ``[C, 1, H', W']`` (frame 0's latent).

Only the VAE's encoder half is kept here; the decode worker keeps the decoder half. The encode runs tiled
as the decode worker's decode would at the request's size (``VaeTiling``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.parts.condition import IMAGE_CONDITION, IMAGE_EMBEDS
from common.diffusion.loading import load_component


def first_frame_mask(num_frames: int, latent_frames: int, height: int, width: int, temporal: int,
                     last_image: bool) -> torch.Tensor:
    """The 4-channel mask ``WanImageToVideoPipeline.prepare_latents`` puts before the condition latents:
    [temporal, F', H', W'], 1 where a frame is given (the first, and the last with a last image)."""
    mask = torch.ones(1, 1, num_frames, height, width)
    mask[:, :, 1 : num_frames - 1 if last_image else num_frames] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)
    return mask.view(1, latent_frames, temporal, height, width).transpose(1, 2)[0]


class WanImageConditioner:
    """The image encoder (when the model has one), its processor, the VAE's encoder half and the resize."""

    def __init__(self, vae, video_processor, image_encoder, image_processor, expand_timesteps: bool, device,
                 tiling: VaeTiling = VaeTiling()):
        self.vae, self.video_processor, self.device, self.tiling = vae, video_processor, device, tiling
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.expand_timesteps = expand_timesteps
        z = vae.config.z_dim
        self.latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
        self.latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        self.temporal = int(vae.config.scale_factor_temporal)
        self.spatial = int(vae.config.scale_factor_spatial)

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, device, expand_timesteps: bool, image_encoder: bool,
             tiling: VaeTiling = VaeTiling()) -> "WanImageConditioner":
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        vae = load_component(AutoencoderKLWan, path / "vae", dtype)
        vae.decoder = None  # this worker only encodes: the decode worker holds the decoder
        vae = vae.to(device).eval().requires_grad_(False)
        encoder = processor = None
        if image_encoder:
            from transformers import CLIPImageProcessor, CLIPVisionModel

            processor = CLIPImageProcessor.from_pretrained(path / "image_processor")
            encoder = load_component(CLIPVisionModel, path / "image_encoder", dtype)
            encoder = encoder.to(device).eval().requires_grad_(False)
        video_processor = VideoProcessor(vae_scale_factor=int(vae.config.scale_factor_spatial))
        return cls(vae, video_processor, encoder, processor, expand_timesteps, device, tiling)

    @torch.no_grad()
    def embeds(self, images: list) -> torch.Tensor:
        """[k, tokens, D]: the CLIP vision encoder's second-to-last hidden state of each PIL image."""
        pixels = self.image_processor(images=images, return_tensors="pt").to(self.device)
        return self.image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]

    @torch.no_grad()
    def condition(self, image, last_image, height: int, width: int, num_frames: int) -> torch.Tensor:
        """The normalised condition latents of one request (see the module docstring), float32."""
        first = self.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        first = first.unsqueeze(2)  # [1, 3, 1, H, W]
        if self.expand_timesteps:
            video = first
        else:
            parts = [first, first.new_zeros(1, 3, num_frames - 1 - (last_image is not None), height, width)]
            if last_image is not None:
                last = self.video_processor.preprocess(last_image, height=height, width=width)
                parts.append(last.to(self.device, torch.float32).unsqueeze(2))
            video = torch.cat(parts, dim=2)
        self.tiling.apply(self.vae, video.shape[2], height, width)
        posterior = self.vae.encode(video.to(self.vae.dtype)).latent_dist
        latents = posterior.mode().float()
        latents = (latents - self.latents_mean.to(latents.device)) * self.latents_std.to(latents.device)
        if self.expand_timesteps:
            return latents[0]
        _, _, frames, h, w = latents.shape
        mask = first_frame_mask(num_frames, frames, h, w, self.temporal, last_image is not None)
        return torch.cat([mask.to(latents.device), latents[0]], dim=0)

    def wire_tensors(self, image, last_image, height: int, width: int, num_frames: int) -> dict[str, torch.Tensor]:
        """One request's image tensors as they travel to the denoise worker (PIL images in)."""
        out = {IMAGE_CONDITION.name: self.condition(image, last_image, height, width, num_frames)}
        if self.image_encoder is not None:
            out[IMAGE_EMBEDS.name] = self.embeds([image] if last_image is None else [image, last_image])
        return out

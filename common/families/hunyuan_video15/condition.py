"""HunyuanVideo 1.5's condition channels: the transformer takes ``[latents, condition latents, mask]`` on the
channel axis (``2 C + 1`` input channels).

- text-to-video (:class:`NoImage`): both zeros (``prepare_cond_latents_and_mask``);
- image-to-video (:class:`FirstFrameImage`): the image's latent on frame 0 and zeros after it, the mask 1 on
  frame 0; the wire carries frame 0's latent alone (``image_condition`` [C, 1, H', W'], what image.py makes) and
  SigLIP's embeds (``image_embeds``, beside each prompt's text). The condition is a constant of the request: the
  noise latents step as text-to-video's, every element a Gaussian step of a rollout.

The output's size follows the image: the aspect bucket nearest it (image.py's :func:`bucket`), as the pipeline
picks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.parts.condition import IMAGE_CONDITION, IMAGE_EMBEDS, NoCondition


def condition_channels(latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """[n, C + 1, F', H', W']: the condition latents and the mask for latents [n, C, F', H', W']."""
    n, c, frames, h, w = latents.shape
    out = latents.new_zeros(n, c + 1, frames, h, w)
    if image is not None:  # [1, C, 1, H', W']: frame 0's latent
        out[:, :c, :1] = image.to(latents.dtype)
        out[:, c, 0] = 1.0
    return out


@dataclass(frozen=True, kw_only=True)
class NoImage(NoCondition):
    def model_latents(self, info, latents, image):
        return torch.cat([latents, condition_channels(latents, None)], dim=1)


@dataclass(frozen=True, kw_only=True)
class FirstFrameImage(NoImage):
    fields: tuple = (IMAGE_EMBEDS, IMAGE_CONDITION)
    text_fields: frozenset[str] = frozenset({IMAGE_EMBEDS.name})

    def image_input(self, info):
        return "required"

    def load(self, info, dtype, device, tiling=None):
        from common.diffusion.vae_tiling import VaeTiling
        from common.families.hunyuan_video15.image import HunyuanVideo15ImageConditioner

        return HunyuanVideo15ImageConditioner.load(info.path, dtype, device, tiling or VaeTiling())

    def wire_tensors(self, conditioner, images, last_image, params):
        return conditioner.wire_tensors(images[0], params.height, params.width)

    def cache_key(self, params):
        return params.height, params.width

    def default_size(self, info, sizes, fields):
        from common.families.hunyuan_video15.image import bucket

        return None if not sizes else bucket(info, *sizes[0])

    def from_wire(self, wire):
        c = wire.get(IMAGE_CONDITION.name)
        return None if c is None else c[None]

    def model_latents(self, info, latents, image):
        return torch.cat([latents, condition_channels(latents, image)], dim=1)

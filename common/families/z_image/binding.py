"""Z-Image (``ZImagePipeline``).

- encoder: Qwen3's second-to-last hidden state of the prompt in its chat template, real tokens only
  (:mod:`common.families.z_image.text`); a prompt travels as ``prompt_embeds`` [L, D], its own length;
- denoise: ``ZImageTransformer2DModel`` on plain latents ``[16, H / 8, W / 8]`` (it patchifies them itself),
  texts as a list, timestep ``(1000 - t) / 1000``, output negated (:mod:`~common.families.z_image.transformer`);
  guidance on when ``guidance_scale > 0``, two forwards, ``pos + g (pos - neg)`` with ``cfg_normalization`` and
  ``cfg_truncation`` (:mod:`~common.families.z_image.guidance`);
- schedule: flow-match Euler with the directory's shift (static for Z-Image-Turbo; ``mu`` from the image tokens
  where the config shifts dynamically), sigmas ``linspace(1, 1/N, N)``;
- decode: ``AutoencoderKL`` (16 channels), ``latents / scaling_factor + shift_factor``.
"""

from __future__ import annotations

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.decoder import AutoencoderKLDecoder
from common.diffusion.parts.latents import Geometry, LatentsPart, autoencoder_kl_scale
from common.diffusion.parts.text import HIDDEN, MaskedText, TextCond
from common.diffusion.request_fields import max_sequence_length
from common.families.z_image.fields import DEFAULTS, FIELDS
from common.families.z_image.guidance import ZImageGuidance
from common.families.z_image.transformer import MASK, ZImageTransformer
from common.protocol.messages import PROMPT_EMBEDS


def geometry(path, transformer_config: dict) -> Geometry:
    p = int(transformer_config.get("all_patch_size", [2])[0])
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 16)),
                    vae_scale_spatial=autoencoder_kl_scale(path), patch_size=(p, p))


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.z_image.text import ZImageTextEncoder

    return ZImageTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    # One token past the transformer's padding multiple (diffusers' SEQ_MULTI_OF): the --compile warm-up's text
    # one shorter pads to another length, so its forward of both is the masked one.
    from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

    width = model.config.cap_feat_dim
    return TextCond({HIDDEN: torch.randn(1, min(max_sequence_length, SEQ_MULTI_OF + 1), width, generator=generator,
                                         device=device, dtype=dtype)})


Z_IMAGE = Binding(
    family="z-image", pipeline="ZImagePipeline", words=("z-image",),
    text=MaskedText(fields=(PROMPT_EMBEDS,), keywords=(HIDDEN,), load_encoder=load_text_encoder,
                    example=example_text, mask=MASK),
    latents=LatentsPart(geometry=geometry), transformer=ZImageTransformer(), decoder=AutoencoderKLDecoder,
    guidance=ZImageGuidance(), defaults=DEFAULTS,
    # 512: the pipeline's default budget; longer captions would outrun the transformer's rotary table.
    request_fields=(max_sequence_length(512), *FIELDS))

"""FLUX.2 [klein] (``Flux2KleinPipeline``).

- encoder: Qwen3's stacked hidden states of the prompt in its chat template, padded to ``max_sequence_length``
  (:mod:`.text`); reference images for editing as tokens (:mod:`.images`, the shared ``ReferenceTokens``);
- denoise: ``Flux2Transformer2DModel`` (:mod:`.transformer`) on the pipeline's latents: noise drawn as
  ``[C * 4, H / 16, W / 16]`` (2x2 patches of the VAE latent folded into channels) and flattened, one token
  per position; classifier-free guidance with the empty prompt as the negative (two forwards), only on a
  checkpoint that is not step-distilled (model_index.json's ``is_distilled``) and above 1;
- schedule: flow-match Euler with the pipeline's ``mu`` (``compute_empirical_mu`` of the noise tokens and the
  steps), sigmas ``linspace(1, 1/N, N)``;
- decode: ``AutoencoderKLFlux2`` after its batch-norm de-normalisation (:mod:`.vae`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.model_info import read_index
from common.diffusion.parts.guidance import Guidance
from common.diffusion.parts.latents import Geometry, PackedLatents, autoencoder_kl_scale
from common.diffusion.parts.reference import ReferenceTokens
from common.diffusion.parts.text import HIDDEN, TextCond, TextPart
from common.diffusion.request_fields import max_sequence_length
from common.families.flux2.images import load_conditioner, size_from_images
from common.families.flux2.transformer import Flux2Transformer
from common.families.flux2.vae import Flux2Decoder
from common.protocol.messages import PROMPT_EMBEDS

MAX_REFERENCES = 3  # the most images a request carries (router/request/schemas.py MAX_IMAGES); the pipeline sets none


@dataclass(frozen=True)
class KleinGeometry(Geometry):
    distilled: bool = False  # model_index.json's is_distilled: no classifier-free guidance


def geometry(path, transformer_config: dict) -> KleinGeometry:
    return KleinGeometry(latent_channels=int(transformer_config.get("in_channels", 128)) // 4,
                         vae_scale_spatial=autoencoder_kl_scale(path), patch_size=(2, 2),
                         distilled=bool(read_index(path).get("is_distilled", False)))


def distilled(info) -> bool:
    return bool(info.index.get("is_distilled", False))


@dataclass(frozen=True, kw_only=True)
class KleinLatents(PackedLatents):
    """Noise drawn patchified, ``[1, C * 4, rows, cols]``, each position a token (the pipeline's
    ``prepare_latents``); unpacked back to that layout for the decoder."""

    def noise_shape(self, info, height, width, num_frames=1):
        rows, cols = self.token_grid(info, height, width)
        return (1, info.latent_channels * 4, rows, cols)

    def pack(self, noise, info, height, width):
        return noise.flatten(2).transpose(1, 2)

    def unpack(self, latents, info, height, width):
        rows, cols = self.token_grid(info, height, width)
        return latents.transpose(1, 2).reshape(latents.shape[0], -1, rows, cols)

    def mu(self, info, params) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        return compute_empirical_mu(self.seq_len(info, params), params.num_inference_steps)


@dataclass(frozen=True, kw_only=True)
class KleinGuidance(Guidance):
    default_sigmas: bool = True

    def refusal(self, info, request: dict) -> tuple[str, str] | None:
        if request.get("negative_prompt") is not None:
            return "negative_prompt", (f"{info.family.pipeline} takes no negative prompt: its classifier-free "
                                       "guidance's negative is the empty prompt")
        g = request.get("guidance_scale")
        if g is not None and g > 1.0 and distilled(info):
            return "guidance_scale", ("this step-distilled FLUX.2 [klein] model (is_distilled) runs without "
                                      f"classifier-free guidance: give at most 1, got {g}")
        return None


@dataclass(frozen=True, eq=False)
class KleinBinding(Binding):
    def pipeline_defaults(self, transformer_config, geometry):
        defaults = super().pipeline_defaults(transformer_config, geometry)
        if getattr(geometry, "distilled", False):  # the pipeline ignores its 4.0 there
            defaults["guidance_scale"] = 1.0
        return defaults


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.flux2.text import Flux2KleinTextEncoder

    return Flux2KleinTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    return TextCond({HIDDEN: torch.randn(1, max_sequence_length, model.config.joint_attention_dim,
                                         generator=generator, device=device, dtype=dtype)})


FLUX2_KLEIN = KleinBinding(
    family="flux2-klein", pipeline="Flux2KleinPipeline", words=("flux2", "klein"),
    # Flux2Transformer2DModel takes no text mask (the pipeline passes none): padding tokens are attended.
    text=TextPart(fields=(PROMPT_EMBEDS,), keywords=(HIDDEN,), load_encoder=load_text_encoder, example=example_text),
    latents=KleinLatents(geometry=geometry), transformer=Flux2Transformer(), decoder=Flux2Decoder,
    guidance=KleinGuidance(),
    condition=ReferenceTokens(loader=load_conditioner, required=False, max_images=MAX_REFERENCES,
                              size_from_images=size_from_images),
    # Flux2KleinPipeline's own defaults (its default_sample_size 128 x the VAE's scale).
    defaults={"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 50, "guidance_scale": 4.0,
              "max_sequence_length": 512},
    default_size=lambda tcfg, geometry: 128 * geometry.vae_scale_spatial,
    request_fields=(max_sequence_length(),))

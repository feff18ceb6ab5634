"""HunyuanVideo 1.5 image-to-video's image side, run by the encoder worker (and by a trainer's recompute).

As ``HunyuanVideo15ImageToVideoPipeline`` makes them from one image resized (center crop) to the request's
size: SigLIP's ``last_hidden_state`` of the resized image (``image_embeds`` [1, tokens, D]) and the VAE's
encoding (the posterior's mode) of it times ``scaling_factor`` (``image_condition`` [C, 1, H', W']). The size
a request leaves out is the aspect bucket nearest the image's (:func:`bucket`: diffusers' own
``HunyuanVideo15ImageProcessor.calculate_default_height_width`` at the transformer's ``target_size``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.parts.condition import IMAGE_CONDITION, IMAGE_EMBEDS
from common.diffusion.loading import load_component


def _processor(spatial: int):
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    return HunyuanVideo15ImageProcessor(vae_scale_factor=spatial, do_resize=False, do_convert_rgb=True)


def bucket(info, width: int, height: int) -> tuple[int, int]:
    """The (height, width) the pipeline makes for an image of ``width`` x ``height``."""
    return _processor(info.vae_scale_spatial).calculate_default_height_width(
        height=height, width=width, target_size=info.transformer_config.get("target_size", 640))


class HunyuanVideo15ImageConditioner:
    def __init__(self, vae, image_encoder, feature_extractor, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.image_encoder, self.feature_extractor = vae, image_encoder, feature_extractor
        self.device, self.tiling = device, tiling
        self.processor = _processor(int(vae.config.spatial_compression_ratio))

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype, device,
             tiling: VaeTiling = VaeTiling()) -> "HunyuanVideo15ImageConditioner":
        import transformers
        from diffusers import AutoencoderKLHunyuanVideo15

        def ready(m):
            return m.to(device).eval().requires_grad_(False)

        vae = load_component(AutoencoderKLHunyuanVideo15, path / "vae", dtype)
        vae.decoder = None  # this worker only encodes: the decode worker holds the decoder
        encoder = load_component(transformers.SiglipVisionModel, path / "image_encoder", dtype)
        extractor = transformers.SiglipImageProcessor.from_pretrained(path / "feature_extractor")
        return cls(ready(vae), ready(encoder), extractor, device, tiling)

    @torch.no_grad()
    def wire_tensors(self, image, height: int, width: int) -> dict[str, torch.Tensor]:
        from diffusers import HunyuanVideo15ImageToVideoPipeline as Pipe

        image = self.processor.resize(image, height=height, width=width, resize_mode="crop")
        embeds = Pipe._get_image_embeds(image_encoder=self.image_encoder, feature_extractor=self.feature_extractor,
                                        image=image, device=self.device)
        self.tiling.apply(self.vae, 1, height, width)
        latents = Pipe._get_image_latents(vae=self.vae, image_processor=self.processor, image=image, height=height,
                                          width=width, device=self.device)
        return {IMAGE_EMBEDS.name: embeds, IMAGE_CONDITION.name: latents[0]}

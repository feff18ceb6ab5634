"""LTX-2 image-to-video's image side, run by the encoder worker (and by a trainer's recompute).

From a request's image it makes frame 0's latent as ``LTX2ImageToVideoPipeline`` makes ``init_latents`` (before
their repeat over the latent frames): the image re-compressed as one H.264 frame at ``image_crf`` (diffusers'
``apply_image_conditioning_crf``; 0 skips it; by default the CRF diffusers' ``resolve_default_image_crf`` gives
for the text encoder's ``model_type``, read from ``text_encoder/config.json``), resized to the request's size
(``VideoProcessor.preprocess``, bilinear as the pipeline's), encoded by the video VAE (the posterior's mode) and normalised by the VAE's
``latents_mean`` / ``latents_std`` without a scaling factor. It travels as ``image_condition`` [C, 1, H', W'].

Only the VAE's encoder half is kept here; the decode worker keeps the decoder half.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from common.diffusion.request_fields import RequestField, field_value
from common.diffusion.vae_tiling import VaeTiling
from common.diffusion.parts.condition import IMAGE_CONDITION
from common.diffusion.loading import load_component

IMAGE_CRF = RequestField("image_crf", int, "image-to-video: the H.264 CRF the image is re-compressed at before "
                         "it is encoded, as the model was trained (0: not re-compressed; default: the model's)",
                         minimum=0, maximum=51, needs_image=True)


def default_crf(path: Path) -> int:
    """The pipeline's default CRF for the text encoder of ``path``, from its config alone (no weights)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    config = json.loads((Path(path) / "text_encoder" / "config.json").read_text())
    return int(resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(**config))))


class Ltx2ImageConditioner:
    """The video VAE's encoder half, the resize, and the CRF a request without ``image_crf`` gets."""

    def __init__(self, vae, video_processor, crf: int, device, tiling: VaeTiling = VaeTiling()):
        self.vae, self.video_processor, self.default_crf = vae, video_processor, crf
        self.device, self.tiling = device, tiling

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device,
             tiling: VaeTiling = VaeTiling()) -> "Ltx2ImageConditioner":
        from diffusers import AutoencoderKLLTX2Video
        from diffusers.video_processor import VideoProcessor

        path = Path(path)
        vae = load_component(AutoencoderKLLTX2Video, path / "vae", dtype)
        vae.decoder = None  # this worker only encodes: the decode worker holds the decoder
        vae = vae.to(device).eval().requires_grad_(False)
        # Bilinear, as LTX2ImageToVideoPipeline's processor resizes (not the processor's default).
        processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear")
        return cls(vae, processor, default_crf(path), device, tiling)

    def crf(self, params) -> int:
        value = field_value(params, IMAGE_CRF.name)
        return self.default_crf if value is None else int(value)

    @torch.no_grad()
    def condition(self, image, height: int, width: int, crf: int) -> torch.Tensor:
        """Frame 0's normalised latent [C, 1, H', W'] (float32) of one PIL image."""
        import numpy as np
        import PIL.Image
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

        if crf:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        pixels = self.video_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(self.device, self.vae.dtype).unsqueeze(2)  # [1, 3, 1, H, W]
        self.tiling.apply(self.vae, 1, height, width)
        latents = self.vae.encode(pixels).latent_dist.mode().float()
        c = latents.shape[1]
        mean = self.vae.latents_mean.view(1, c, 1, 1, 1).to(latents)
        std = self.vae.latents_std.view(1, c, 1, 1, 1).to(latents)
        return ((latents - mean) / std)[0]  # the pipeline's _normalize_latents with scaling factor 1

    def wire_tensors(self, images: list, last_image, params) -> dict[str, torch.Tensor]:
        """One request's image tensors for the denoise worker (``images``: its PIL image, in a list; the model
        takes no last image)."""
        if last_image is not None:
            raise ValueError("last_image: LTX-2 conditions on a first frame only")
        return {IMAGE_CONDITION.name: self.condition(images[0], params.height, params.width, self.crf(params))}

    @staticmethod
    def cache_key(params) -> tuple:
        """What of ``params`` the image's tensors depend on (the encoder worker's cache key, beside the pixels)."""
        return params.height, params.width, field_value(params, IMAGE_CRF.name)


def load_conditioner(info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()) -> Ltx2ImageConditioner:
    return Ltx2ImageConditioner.load(info.path, dtype, device, tiling)

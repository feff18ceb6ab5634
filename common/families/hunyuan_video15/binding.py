"""HunyuanVideo 1.5 (``HunyuanVideo15Pipeline``, ``HunyuanVideo15ImageToVideoPipeline``).

- encoder: Qwen2.5-VL behind the pipeline's template and ByT5 for quoted text (:mod:`.text`); image-to-video
  adds SigLIP's embeds and the image's latent (:mod:`.image`), at the aspect bucket nearest the image;
- denoise: ``HunyuanVideo15Transformer3DModel`` on ``[latents, condition, mask]`` (:mod:`.condition`), guidance
  through the directory's guider with the request's ``guidance_scale`` (:mod:`.guidance`);
- schedule: flow-match Euler with the directory's shift, sigmas ``linspace(1, 0, N + 1)[:-1]``;
- decode: ``AutoencoderKLHunyuanVideo15`` (:mod:`.decoder`).

The latents are ``[C, (F - 1) / 4 + 1, H / 16, W / 16]`` (``patch_size`` 1). Directories whose guider is not
``ClassifierFreeGuidance`` with its defaults besides the scale, or whose transformer uses mean flow (the
image-to-video pipeline's ``timestep_r``), are refused when read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.diffusion.binding import Binding
from common.diffusion.parts.latents import Geometry, LatentsPart, vae_config
from common.diffusion.request_fields import NUM_FRAMES, max_sequence_length
from common.families.hunyuan_video15.condition import FirstFrameImage, NoImage
from common.families.hunyuan_video15.decoder import HunyuanVideo15Decoder
from common.families.hunyuan_video15.guidance import HunyuanVideo15Guidance, HunyuanVideo15I2VGuidance
from common.families.hunyuan_video15.text import TEXT, TOKENIZER_MAX_LENGTH
from common.families.hunyuan_video15.transformer import HunyuanVideo15Transformer

# The pipelines' own defaults (their __call__ signatures; the guider's scale is read from the directory).
DEFAULTS = {"num_frames": 121, "num_inference_steps": 50, "guidance_scale": 6.0,
            "max_sequence_length": TOKENIZER_MAX_LENGTH}
# ClassifierFreeGuidance's settings this engine combines as the guider does (its defaults).
GUIDER_DEFAULTS = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0,
                   "enabled": True}
FIELDS = (NUM_FRAMES, max_sequence_length(TOKENIZER_MAX_LENGTH))


@dataclass(frozen=True)
class HunyuanVideo15Geometry(Geometry):
    guidance_scale: float = 6.0  # the directory's guider's
    target_size: int = 640


def guider_scale(path: Path) -> float:
    """The guider's scale, after checking its other settings are the ones :mod:`.guidance` combines."""
    config = json.loads((Path(path) / "guider" / "guider_config.json").read_text())
    if config.get("_class_name") != "ClassifierFreeGuidance":
        raise ValueError(f"{path}: guider {config.get('_class_name')!r}; the engine combines ClassifierFreeGuidance")
    other = {k: config[k] for k, v in GUIDER_DEFAULTS.items() if k in config and config[k] != v}
    if other:
        raise ValueError(f"{path}: guider settings {other} are not served (the engine combines "
                         f"ClassifierFreeGuidance with {GUIDER_DEFAULTS} and the request's guidance_scale)")
    return float(config.get("guidance_scale", 7.5))


def geometry(path, transformer_config: dict) -> HunyuanVideo15Geometry:
    if transformer_config.get("use_meanflow"):
        raise ValueError(f"{path}: mean-flow transformers (use_meanflow, the step-distilled image-to-video "
                         "checkpoint) are not served")
    vcfg = vae_config(path)
    p, pt = int(transformer_config.get("patch_size", 1)), int(transformer_config.get("patch_size_t", 1))
    return HunyuanVideo15Geometry(
        latent_channels=int(transformer_config.get("out_channels") or vcfg.get("latent_channels", 32)),
        vae_scale_spatial=int(vcfg.get("spatial_compression_ratio", 16)),
        vae_scale_temporal=int(vcfg.get("temporal_compression_ratio", 4)), patch_size=(pt, p, p),
        guidance_scale=guider_scale(path), target_size=int(transformer_config.get("target_size", 640)))


@dataclass(frozen=True, eq=False)
class HunyuanVideo15Binding(Binding):
    def pipeline_defaults(self, transformer_config, geometry) -> dict:
        """The pipeline's defaults with the guider's scale and, text-to-video, its 16:9 bucket of ``target_size``."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=geometry.vae_scale_spatial)
        height, width = processor.calculate_default_height_width(9, 16, geometry.target_size)
        return {**self.defaults, "guidance_scale": geometry.guidance_scale, "height": height, "width": width}


_COMMON = dict(text=TEXT, latents=LatentsPart(geometry=geometry, video=True), transformer=HunyuanVideo15Transformer(),
               decoder=HunyuanVideo15Decoder, guidance=HunyuanVideo15Guidance(), fps=24, defaults=DEFAULTS,
               request_fields=FIELDS, words=("hunyuan",))

HUNYUAN_VIDEO15 = HunyuanVideo15Binding(family="hunyuan-video15", pipeline="HunyuanVideo15Pipeline",
                                        condition=NoImage(), **_COMMON)
HUNYUAN_VIDEO15_I2V = HunyuanVideo15Binding(family="hunyuan-video15-i2v",
                                            pipeline="HunyuanVideo15ImageToVideoPipeline",
                                            **{**_COMMON, "condition": FirstFrameImage(),
                                               "guidance": HunyuanVideo15I2VGuidance()})

"""The built-in Qwen-Image-Edit models (``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``): Qwen-Image's
components (:mod:`common.builtin.specs.qwen_image`) plus the ``processor`` the real checkpoints ship
(Qwen2.5-VL's image processor beside the tokenizer), whose settings agree with the tiny vision tower's
(14 px patches, 2x2 merge), so the text encoder really sees the request's images: ``processor_max_pixels``
keeps an image to a few dozen vision tokens."""

from __future__ import annotations

from dataclasses import dataclass

from common.builtin.specs.qwen_image import TinyQwenImageSpec, components as qwen_image_components
from common.builtin.text_encoders import QWEN_VISION_PATCH_SIZE, QWEN_VISION_SPATIAL_MERGE_SIZE, \
    QWEN_VISION_TEMPORAL_PATCH_SIZE

# One merged vision token covers this many pixels on a side (Qwen2.5-VL: 28).
VISION_TOKEN_PIXELS = QWEN_VISION_PATCH_SIZE * QWEN_VISION_SPATIAL_MERGE_SIZE
# Qwen2.5-VL's preprocessor_config.json: min_pixels 3136 (4 merged tokens); its max_pixels (12845056) would
# give a 1024x1024 image 1296 vision tokens, too many for a tiny model's tests.
PROCESSOR_MIN_PIXELS = 56 * 56


@dataclass(frozen=True)
class TinyQwenImageEditSpec(TinyQwenImageSpec):
    """A tiny Qwen-Image-Edit: Qwen-Image's sizes, the processor's pixel budget and the transformer's
    ``zero_cond_t`` (Qwen-Image-Edit-2511's: the reference tokens modulated at timestep 0)."""

    PIPELINE = "QwenImageEditPipeline"

    # The pipelines encode every reference at a 1024x1024 area whatever the output size: a narrower VAE
    # (4.2 s against 5.8 s for Qwen-Image's tiny one per 1024x1024 encode on 2 CPU threads).
    vae_base_dim: int = 4
    vae_dim_mult: tuple[int, ...] = (1, 2, 2, 2)
    # At most this many merged vision tokens per image (smart_resize's max_pixels = this * 28 * 28).
    processor_max_tokens: int = 36
    zero_cond_t: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.processor_max_tokens < PROCESSOR_MIN_PIXELS // VISION_TOKEN_PIXELS ** 2:
            raise ValueError(f"processor_max_tokens must be >= {PROCESSOR_MIN_PIXELS // VISION_TOKEN_PIXELS ** 2}")


@dataclass(frozen=True)
class TinyQwenImageEditPlusSpec(TinyQwenImageEditSpec):
    """A tiny Qwen-Image-Edit-Plus (2509: up to three images, each named "Picture k:" in the prompt)."""

    PIPELINE = "QwenImageEditPlusPipeline"


SPECS: dict[str, TinyQwenImageEditSpec] = {
    spec.name: spec
    for spec in (
        TinyQwenImageEditSpec(name="tiny-qwen-image-edit"),
        TinyQwenImageEditPlusSpec(name="tiny-qwen-image-edit-plus"),
        # small-qwen-image's transformer for CPU benchmarks, with 256x256 edits.
        TinyQwenImageEditSpec(name="small-qwen-image-edit", num_layers=8, num_attention_heads=4,
                              attention_head_dim=64, axes_dims_rope=(8, 28, 28), text_hidden_size=128,
                              text_num_heads=4, text_num_kv_heads=2, text_intermediate_size=256,
                              vision_hidden_size=32, vision_intermediate_size=64, vae_base_dim=16, seed=1,
                              height=256, width=256, num_inference_steps=10),
        # The same for Edit-Plus (several pictures per request).
        TinyQwenImageEditPlusSpec(name="small-qwen-image-edit-plus", num_layers=8, num_attention_heads=4,
                                  attention_head_dim=64, axes_dims_rope=(8, 28, 28), text_hidden_size=128,
                                  text_num_heads=4, text_num_kv_heads=2, text_intermediate_size=256,
                                  vision_hidden_size=32, vision_intermediate_size=64, vae_base_dim=16, seed=1,
                                  height=256, width=256, num_inference_steps=10),
    )
}


def processor(spec: TinyQwenImageEditSpec, tokenizer):
    """Qwen2.5-VL's image processor (its preprocessor_config.json, with the spec's pixel budget) and
    ``tokenizer``."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from common.families.qwen_image.processor import image_text_processor

    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=PROCESSOR_MIN_PIXELS, max_pixels=spec.processor_max_tokens * VISION_TOKEN_PIXELS ** 2,
        patch_size=QWEN_VISION_PATCH_SIZE, temporal_patch_size=QWEN_VISION_TEMPORAL_PATCH_SIZE,
        merge_size=QWEN_VISION_SPATIAL_MERGE_SIZE)
    return image_text_processor()(image_processor, tokenizer)


def components(spec: TinyQwenImageEditSpec) -> dict:
    """Qwen-Image's components of ``spec`` (the transformer with its ``zero_cond_t`` when set) plus the
    processor, which shares the tokenizer."""
    from diffusers import QwenImageTransformer2DModel

    from common.builtin.build import seeded
    from common.builtin.specs.qwen_image import transformer_config

    parts = qwen_image_components(spec)
    if spec.zero_cond_t:  # (the key absent otherwise, as the checkpoints without it)
        config = transformer_config(spec) | {"zero_cond_t": True}
        parts["transformer"] = seeded(spec, "transformer", lambda: QwenImageTransformer2DModel(**config))
    return parts | {"processor": processor(spec, parts["tokenizer"])}


# The parity sweep's choices (common/builtin/sweep.py): the transformer, the text model, the VAE's widths, the
# processor's token budget, and the request.
SWEEP_KNOBS = {
    "num_layers": (1, 2), "num_attention_heads": (1, 2, 3), "attention_head_dim": (16, 24),
    "axes_dims_rope": ((4, 6, 6), (8, 4, 4)), "text_hidden_size": (32, 64), "text_num_layers": (1, 2),
    "vae_base_dim": (4, 8), "vae_dim_mult": ((1, 2, 2, 2), (1, 1, 2, 4), (1, 1, 2, 2, 2)), "processor_max_tokens": (36, 64),
    "height": (32, 64), "width": (32, 48, 64), "num_inference_steps": (2, 3), "true_cfg_scale": (1.0, 4.0),
}

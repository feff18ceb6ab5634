"""Factories of the image encoders: CLIP vision (Wan2.1 I2V's, as open-clip ViT-H/14) and its image
processor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.builtin.build import seeded

if TYPE_CHECKING:
    from transformers import CLIPImageProcessor, CLIPVisionModel


def clip_vision_config(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, image_size: int,
                       patch_size: int) -> dict:
    """``CLIPVisionConfig`` arguments: open-clip ViT-H/14's kind (gelu, eps 1e-5) with these sizes."""
    return dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        projection_dim=hidden_size,  # unused by CLIPVisionModel
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )


def clip_vision_encoder(spec, component: str, **config) -> CLIPVisionModel:
    """``CLIPVisionModel`` of :func:`clip_vision_config`."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return seeded(spec, component, lambda: CLIPVisionModel(CLIPVisionConfig(**clip_vision_config(**config))))


def clip_image_processor(side: int) -> CLIPImageProcessor:
    """CLIP's own preprocessing (bicubic resize of the shorter side, center crop, OpenAI mean/std) to ``side``
    pixels, as transformers' PIL implementation (model_index.json names it CLIPImageProcessor:
    :data:`common.builtin.build.SAVED_AS`)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})

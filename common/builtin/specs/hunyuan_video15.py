"""The built-in HunyuanVideo 1.5 models: :class:`TinyHunyuanVideo15Spec` (one configuration plus the request it
serves), the table of named specs, :data:`SPECS`, and their pipeline's :func:`components`: the layout of a real
``hunyuanvideo-community/HunyuanVideo-1.5-*`` checkpoint (a Qwen2.5-VL language model in ``text_encoder/`` with its
Qwen2 tokenizer and chat template, a ByT5 encoder in ``text_encoder_2/``, the ``guider``; image-to-video adds a
SigLIP vision model and its image processor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.builtin.build import seeded
from common.builtin.spec import BuiltinSpec, check_weights_dtype

# AutoencoderKLHunyuanVideo15's strides (16x spatial, 4x temporal), as the real VAE's.
VAE_SPATIAL = 16
VAE_TEMPORAL = 4
VAE_SCALING_FACTOR = 1.03682
# The FlowMatchEulerDiscreteScheduler the 480p checkpoints ship (shift 5; 720p: 9 / 7), the rest its defaults.
SCHEDULER_SHIFT = 5.0
# Qwen2.5-VL's chat template for text-only conversations (the real tokenizer's, for string contents): the
# pipeline prompts it with a system message and a user turn and asks for the assistant's turn.
CHAT_TEMPLATE = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
                 "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
                 "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MROPE_PROPORTIONS = (2, 3, 3)  # Qwen2.5-VL's temporal / height / width rotary sections (16 / 24 / 24 of 64)


@dataclass(frozen=True)
class TinyHunyuanVideo15Spec(BuiltinSpec):
    """One tiny HunyuanVideo 1.5 configuration (text-to-video, or image-to-video) plus its default request."""

    PIPELINE = "HunyuanVideo15Pipeline"  # the family's (the class attribute); :attr:`pipeline` is this spec's
    SERVING_DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")

    name: str
    image_to_video: bool = False
    # TeaCache's polynomial the built directory carries in step_cache.json (none is published for HunyuanVideo
    # 1.5): a line fitted on small-hunyuan-video15-smooth by bench/fit_teacache.py --degree 1 (2 prompts, 20
    # steps: R^2 0.97).
    teacache_coefficients: tuple[float, ...] = (5.29701137e-01, 8.02939043e-03)
    TEACACHE_FITTED_ON: ClassVar[str] = "small-hunyuan-video15-smooth"
    # Transformer (HunyuanVideo15Transformer3DModel): rope_axes_dim sums to attention_head_dim.
    num_layers: int = 1
    num_refiner_layers: int = 1
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    rope_axes_dim: tuple[int, int, int] = (4, 6, 6)
    # The pixel size the aspect buckets are made for (the real 480p: 640); a multiple of the VAE's 16.
    target_size: int = 64
    # Text encoder: Qwen2.5-VL's language model (Qwen2_5_VLTextModel), grouped-query attention.
    text_hidden_size: int = 32
    text_num_layers: int = 3  # the pipeline reads hidden_states[-3]
    text_num_heads: int = 2
    text_num_kv_heads: int = 1
    text_intermediate_size: int = 64
    # ByT5 glyph encoder (T5EncoderModel over bytes): its d_model is the transformer's text_embed_2_dim.
    byt5_d_model: int = 16
    byt5_d_kv: int = 8
    byt5_d_ff: int = 32
    byt5_num_layers: int = 1
    byt5_num_heads: int = 2
    # SigLIP (image-to-video; its hidden size is image_embed_dim, which text-to-video models carry too).
    image_embed_dim: int = 16
    siglip_num_layers: int = 1
    siglip_num_heads: int = 2
    siglip_image_size: int = 32
    siglip_patch_size: int = 8
    # VAE (AutoencoderKLHunyuanVideo15): five levels, the first width a multiple of latent_channels; it halves
    # the image at the first log2(VAE_SPATIAL_COMPRESSION) of them (16x as the real one's; a subclass may set
    # another: a class attribute, so that the built-ins' cache keys, and their -smooth variants', stay).
    VAE_SPATIAL_COMPRESSION: ClassVar[int] = VAE_SPATIAL
    latent_channels: int = 8
    vae_block_out_channels: tuple[int, ...] = (8, 8, 16, 16, 16)
    vae_layers_per_block: int = 1
    guider_scale: float = 6.0  # ClassifierFreeGuidance's guidance_scale (the real non-distilled checkpoints')
    # Default request for this model.
    height: int = 48
    width: int = 80
    num_frames: int = 5
    num_inference_steps: int = 3

    def __post_init__(self) -> None:
        for name in ("rope_axes_dim", "vae_block_out_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError("rope_axes_dim must sum to attention_head_dim")
        if self.text_hidden_size % self.text_num_heads or self.text_num_heads % self.text_num_kv_heads:
            raise ValueError("text_hidden_size / text_num_heads / text_num_kv_heads must divide")
        if (self.text_hidden_size // self.text_num_heads) % (2 * sum(MROPE_PROPORTIONS)):
            raise ValueError(f"the text head dim must be a multiple of {2 * sum(MROPE_PROPORTIONS)}")
        if self.text_num_layers < 2:
            raise ValueError("text_num_layers must be >= 2 (the pipeline reads hidden_states[-3])")
        if len(self.vae_block_out_channels) != 5 or self.vae_block_out_channels[0] % self.latent_channels:
            raise ValueError("vae_block_out_channels: five levels, the first a multiple of latent_channels")
        spatial = self.VAE_SPATIAL_COMPRESSION
        # Spatial halvings at the first levels, the temporal ones among them: at least 4x, at most four levels.
        if spatial not in (4, 8, 16):
            raise ValueError("VAE_SPATIAL_COMPRESSION must be 4, 8 or 16")
        for side in (self.height, self.width, self.target_size):
            if side % spatial or side < spatial:
                raise ValueError(f"height, width and target_size must be positive multiples of {spatial}")
        if (self.num_frames - 1) % VAE_TEMPORAL:
            raise ValueError(f"num_frames must be {VAE_TEMPORAL}k+1")
        check_weights_dtype(self)

    @property
    def pipeline(self) -> str:
        return "HunyuanVideo15ImageToVideoPipeline" if self.image_to_video else "HunyuanVideo15Pipeline"

    @property
    def guidance_scale(self) -> float:
        """The serving default: the guider's scale, as the pipeline runs it."""
        return self.guider_scale

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        unit = self.text_hidden_size // self.text_num_heads // (2 * sum(MROPE_PROPORTIONS))
        return tuple(unit * p for p in MROPE_PROPORTIONS)


_TINY = TinyHunyuanVideo15Spec(name="tiny-hunyuan-video15")
# A compute-bound transformer for CPU benchmarks; text encoders and VAE stay small.
_SMALL = TinyHunyuanVideo15Spec(name="small-hunyuan-video15", num_layers=6, num_refiner_layers=2,
                                num_attention_heads=4, attention_head_dim=64, rope_axes_dim=(16, 24, 24),
                                target_size=256, seed=1, height=144, width=256, num_frames=9,
                                num_inference_steps=10)
SPECS: dict[str, TinyHunyuanVideo15Spec] = {
    s.name: s for s in (_TINY, TinyHunyuanVideo15Spec(name="tiny-hunyuan-video15-i2v", image_to_video=True),
                        _SMALL)}


def transformer_config(spec: TinyHunyuanVideo15Spec) -> dict:
    return dict(in_channels=2 * spec.latent_channels + 1, out_channels=spec.latent_channels,
                num_attention_heads=spec.num_attention_heads, attention_head_dim=spec.attention_head_dim,
                num_layers=spec.num_layers, num_refiner_layers=spec.num_refiner_layers, patch_size=1, patch_size_t=1,
                text_embed_dim=spec.text_hidden_size, text_embed_2_dim=spec.byt5_d_model,
                image_embed_dim=spec.image_embed_dim, rope_axes_dim=spec.rope_axes_dim,
                target_size=spec.target_size, task_type="i2v" if spec.image_to_video else "t2v")


def text_encoder(spec: TinyHunyuanVideo15Spec, tokenizer):
    """``Qwen2_5_VLTextModel``: the language model of a tiny Qwen2.5-VL (the pipeline's text_encoder class)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextModel

    from common.builtin.text_encoders import qwen2_5_vl_config

    config = Qwen2_5_VLConfig(**qwen2_5_vl_config(
        tokenizer, hidden_size=spec.text_hidden_size, intermediate_size=spec.text_intermediate_size,
        num_layers=spec.text_num_layers, num_heads=spec.text_num_heads, num_kv_heads=spec.text_num_kv_heads,
        mrope_section=spec.mrope_section, vision_depth=1, vision_hidden_size=16, vision_intermediate_size=32,
        vision_num_heads=2))
    return seeded(spec, "text_encoder", lambda: Qwen2_5_VLTextModel(config.text_config))


def image_parts(spec: TinyHunyuanVideo15Spec) -> dict:
    """SigLIP's vision model and its image processor (transformers' PIL one)."""
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(hidden_size=spec.image_embed_dim, intermediate_size=2 * spec.image_embed_dim,
                                num_hidden_layers=spec.siglip_num_layers, num_attention_heads=spec.siglip_num_heads,
                                image_size=spec.siglip_image_size, patch_size=spec.siglip_patch_size)
    side = spec.siglip_image_size
    return dict(image_encoder=seeded(spec, "image_encoder", lambda: SiglipVisionModel(config)),
                feature_extractor=SiglipImageProcessorPil(size={"height": side, "width": side}))


def components(spec: TinyHunyuanVideo15Spec) -> dict:
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer

    from common.builtin.text_encoders import t5_encoder
    from common.builtin.tokenizer.qwen import qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"  # as the real checkpoint's tokenizer
    tokenizer_2 = ByT5Tokenizer()
    vae = dict(latent_channels=spec.latent_channels, block_out_channels=spec.vae_block_out_channels,
               layers_per_block=spec.vae_layers_per_block, spatial_compression_ratio=spec.VAE_SPATIAL_COMPRESSION,
               temporal_compression_ratio=VAE_TEMPORAL, scaling_factor=VAE_SCALING_FACTOR)
    out = dict(
        transformer=seeded(spec, "transformer", lambda: HunyuanVideo15Transformer3DModel(**transformer_config(spec))),
        vae=seeded(spec, "vae", lambda: AutoencoderKLHunyuanVideo15(**vae)),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=SCHEDULER_SHIFT),
        text_encoder=text_encoder(spec, tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=t5_encoder(spec, "text_encoder_2", vocab_size=len(tokenizer_2), d_model=spec.byt5_d_model,
                                  d_kv=spec.byt5_d_kv, d_ff=spec.byt5_d_ff, num_layers=spec.byt5_num_layers,
                                  num_heads=spec.byt5_num_heads),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=spec.guider_scale),
    )
    return {**out, **(image_parts(spec) if spec.image_to_video else {})}


# The parity sweep's choices (common/builtin/sweep.py): layers, heads and rope axes, the text models, latent
# channels, and the request's size, frames and steps.
SWEEP_KNOBS = {
    "num_layers": (1, 2), "num_refiner_layers": (1, 2), "num_attention_heads": (1, 2),
    "attention_head_dim": (16, 24), "rope_axes_dim": ((4, 6, 6), (8, 4, 4), (4, 10, 10)),
    "latent_channels": (4, 8), "vae_block_out_channels": ((8, 8, 16, 16, 16), (4, 8, 8, 16, 16)),
    "guider_scale": (1.0, 6.0), "height": (32, 48), "width": (48, 80), "num_frames": (1, 5, 9),
    "num_inference_steps": (2, 3),
}

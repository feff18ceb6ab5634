"""Factories of the text encoders several families share, each seeded by :func:`common.builtin.build.seeded`
under its component name: T5 / UMT5 (Wan's umt5-xxl, SD3's and FLUX's t5-v1_1-xxl), CLIP text (CLIP-L,
CLIP-G), Qwen2.5-VL (Qwen-Image's), Gemma2 and Gemma3."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.builtin.build import seeded

if TYPE_CHECKING:
    from transformers import CLIPTextModel, CLIPTokenizer, GemmaTokenizer, PreTrainedModel, Qwen2Tokenizer


def t5_config(vocab_size: int, d_model: int, d_kv: int, d_ff: int, num_layers: int, num_heads: int) -> dict:
    """``T5Config`` / ``UMT5Config`` arguments: t5-v1_1-xxl's and umt5-xxl's structure (gated-gelu, 32 buckets
    / 128 distance) with these sizes."""
    return dict(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=num_layers,
        num_heads=num_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )


def t5_encoder(spec, component: str, umt5: bool = False, **sizes) -> PreTrainedModel:
    """``T5EncoderModel`` (``UMT5EncoderModel`` with ``umt5``) of :func:`t5_config` ``(**sizes)``."""
    import transformers

    kind = "UMT5" if umt5 else "T5"
    config = getattr(transformers, f"{kind}Config")(**t5_config(**sizes))
    return seeded(spec, component, lambda: getattr(transformers, f"{kind}EncoderModel")(config))


def t5_sizes(spec) -> dict:
    """:func:`t5_encoder`'s sizes of a spec's T5 (:class:`common.builtin.spec.T5Sizes`)."""
    return dict(vocab_size=spec.t5_vocab_size, d_model=spec.t5_d_model, d_kv=spec.t5_d_kv, d_ff=spec.t5_d_ff,
                num_layers=spec.t5_num_layers, num_heads=spec.t5_num_heads)


def clip_text_config(tokenizer: CLIPTokenizer, hidden_size: int, intermediate_size: int, projection_dim: int,
                     num_layers: int, num_heads: int, hidden_act: str) -> dict:
    """``CLIPTextConfig`` arguments with these sizes and the tokenizer's vocabulary, context and ids."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        projection_dim=projection_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=tokenizer.model_max_length,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        # The tokenizer's real ids; an eos id other than 2 makes the pooled output the first eos
        # position's (CLIP-L pads with eos, so the legacy argmax would also work, CLIP-G pads with "!").
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def clip_text_encoder(spec, component: str, with_projection: bool, **config) -> CLIPTextModel:
    """``CLIPTextModelWithProjection`` (SD3's) or ``CLIPTextModel`` (FLUX's) of :func:`clip_text_config`."""
    import transformers

    config = transformers.CLIPTextConfig(**clip_text_config(**config))
    model = transformers.CLIPTextModelWithProjection if with_projection else transformers.CLIPTextModel
    return seeded(spec, component, lambda: model(config))


def clip_sizes(spec, prefix: str, tokenizer: CLIPTokenizer) -> dict:
    """:func:`clip_text_encoder`'s config of a spec's CLIP-L (``prefix`` "clip_l",
    :class:`common.builtin.spec.ClipLSizes`) or CLIP-G ("clip_g") with ``tokenizer``: as the real encoders,
    openai's CLIP-L uses quick_gelu, laion's bigG plain gelu."""
    return dict(tokenizer=tokenizer, hidden_size=getattr(spec, f"{prefix}_hidden_size"),
                intermediate_size=getattr(spec, f"{prefix}_intermediate_size"),
                projection_dim=getattr(spec, f"{prefix}_projection_dim"),
                num_layers=getattr(spec, f"{prefix}_num_layers"), num_heads=getattr(spec, f"{prefix}_num_heads"),
                hidden_act="quick_gelu" if prefix == "clip_l" else "gelu")


# Qwen2.5-VL's language-model constants (rotary base, norm epsilon, context length).
QWEN_ROPE_THETA = 1000000.0
QWEN_RMS_NORM_EPS = 1e-6
QWEN_MAX_POSITION_EMBEDDINGS = 128000
# Qwen2.5-VL's vision tower layout: 14 px patches, 2 frames per patch, 2x2 merge, 112 px attention windows.
QWEN_VISION_PATCH_SIZE = 14
QWEN_VISION_TEMPORAL_PATCH_SIZE = 2
QWEN_VISION_SPATIAL_MERGE_SIZE = 2
QWEN_VISION_WINDOW_SIZE = 112
QWEN_VISION_TOKENS_PER_SECOND = 2


def qwen2_5_vl_config(tokenizer: Qwen2Tokenizer, hidden_size: int, intermediate_size: int, num_layers: int,
                      num_heads: int, num_kv_heads: int, mrope_section: tuple[int, ...], vision_depth: int,
                      vision_hidden_size: int, vision_intermediate_size: int, vision_num_heads: int) -> dict:
    """``Qwen2_5_VLConfig`` arguments: Qwen2.5-VL-7B-Instruct's structure (GQA, multimodal RoPE, untied head,
    windowed vision tower) with these sizes and the tokenizer's ids."""
    from common.builtin.tokenizer.qwen import (ENDOFTEXT_TOKEN, IM_END_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN,
                                               VISION_END_TOKEN, VISION_START_TOKEN)

    ids = tokenizer.convert_tokens_to_ids
    return dict(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            hidden_act="silu",
            max_position_embeddings=QWEN_MAX_POSITION_EMBEDDINGS,
            rms_norm_eps=QWEN_RMS_NORM_EPS,
            use_sliding_window=False,
            max_window_layers=num_layers,
            attention_dropout=0.0,
            rope_parameters=dict(rope_type="default", rope_theta=QWEN_ROPE_THETA, mrope_section=list(mrope_section)),
            bos_token_id=ids(ENDOFTEXT_TOKEN),
            eos_token_id=ids(IM_END_TOKEN),
        ),
        vision_config=dict(
            depth=vision_depth,
            hidden_size=vision_hidden_size,
            intermediate_size=vision_intermediate_size,
            num_heads=vision_num_heads,
            hidden_act="silu",
            in_channels=3,
            patch_size=QWEN_VISION_PATCH_SIZE,
            spatial_merge_size=QWEN_VISION_SPATIAL_MERGE_SIZE,
            temporal_patch_size=QWEN_VISION_TEMPORAL_PATCH_SIZE,
            tokens_per_second=QWEN_VISION_TOKENS_PER_SECOND,
            window_size=QWEN_VISION_WINDOW_SIZE,
            out_hidden_size=hidden_size,
            # As the 7B tower's (7, 15, 23, 31) of 32: full attention in the last block of each quarter.
            fullatt_block_indexes=sorted({max(0, (vision_depth * q) // 4 - 1) for q in (1, 2, 3, 4)}),
        ),
        image_token_id=ids(IMAGE_PAD_TOKEN),
        video_token_id=ids(VIDEO_PAD_TOKEN),
        vision_start_token_id=ids(VISION_START_TOKEN),
        vision_end_token_id=ids(VISION_END_TOKEN),
        tie_word_embeddings=False,
    )


def qwen2_5_vl(spec, component: str, **config) -> PreTrainedModel:
    """``Qwen2_5_VLForConditionalGeneration`` of :func:`qwen2_5_vl_config`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**qwen2_5_vl_config(**config))
    return seeded(spec, component, lambda: Qwen2_5_VLForConditionalGeneration(config))


GEMMA_MAX_POSITION_EMBEDDINGS = 8192


def gemma2(spec, component: str, tokenizer: GemmaTokenizer, hidden_size: int, intermediate_size: int,
           num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> PreTrainedModel:
    """``Gemma2Model`` (the decoder's hidden states, no LM head) with ``tokenizer``'s vocabulary and ids."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_layers, num_attention_heads=num_heads,
                          num_key_value_heads=num_kv_heads, head_dim=head_dim,
                          max_position_embeddings=GEMMA_MAX_POSITION_EMBEDDINGS,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id)
    return seeded(spec, component, lambda: Gemma2Model(config))


# Gemma3's interleaved attention: every sixth layer attends globally, the others within a window.
GEMMA3_GLOBAL_EVERY = 6


def gemma3_config(tokenizer: GemmaTokenizer, hidden_size: int, intermediate_size: int, num_layers: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int, vision_hidden_size: int,
                  vision_layers: int, vision_heads: int) -> dict:
    """``Gemma3Config`` arguments: Gemma-3-12B's structure (GQA, a sliding window with a global layer every
    sixth and the last, a SigLIP tower) with these sizes and the tokenizer's ids. The image tokens take the
    three ids after the tokenizer's vocabulary: the text-only pipelines that load it never emit them."""
    vocab = len(tokenizer)
    layer_types = ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 or i == num_layers - 1
                   else "sliding_attention" for i in range(num_layers)]
    patch, image_size = 4, 16  # 4x4 patches of 16 px: 16 patches pooled to 4 tokens per image
    return dict(
        text_config=dict(vocab_size=vocab + 3, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim, sliding_window=sliding_window,
                         layer_types=layer_types, max_position_embeddings=GEMMA_MAX_POSITION_EMBEDDINGS,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                           num_hidden_layers=vision_layers, num_attention_heads=vision_heads, image_size=image_size,
                           patch_size=patch),
        mm_tokens_per_image=4, boi_token_index=vocab, eoi_token_index=vocab + 1, image_token_index=vocab + 2,
    )


def gemma3(spec, component: str, **config) -> PreTrainedModel:
    """``Gemma3ForConditionalGeneration`` of :func:`gemma3_config`."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(**gemma3_config(**config))
    return seeded(spec, component, lambda: Gemma3ForConditionalGeneration(config))


QWEN3_ROPE_THETA = 1000000.0
QWEN3_MAX_POSITION_EMBEDDINGS = 40960


def qwen3(spec, component: str, tokenizer, causal_lm: bool = False) -> PreTrainedModel:
    """Qwen3 (GQA, q/k norms, tied embeddings) with the spec's ``text_*`` sizes and ``tokenizer``'s ids:
    ``Qwen3Model`` (Z-Image's text encoder) or, with ``causal_lm``, ``Qwen3ForCausalLM`` (FLUX.2 [klein]'s)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    from common.builtin.tokenizer.qwen import ENDOFTEXT_TOKEN, IM_END_TOKEN

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=spec.text_hidden_size,
                         intermediate_size=spec.text_intermediate_size, num_hidden_layers=spec.text_num_layers,
                         num_attention_heads=spec.text_num_heads, num_key_value_heads=spec.text_num_kv_heads,
                         head_dim=spec.text_head_dim, hidden_act="silu",
                         max_position_embeddings=QWEN3_MAX_POSITION_EMBEDDINGS, rms_norm_eps=1e-6,
                         rope_parameters=dict(rope_type="default", rope_theta=QWEN3_ROPE_THETA),
                         tie_word_embeddings=True, bos_token_id=ids(ENDOFTEXT_TOKEN), eos_token_id=ids(IM_END_TOKEN),
                         pad_token_id=ids(ENDOFTEXT_TOKEN))
    model_class = Qwen3ForCausalLM if causal_lm else Qwen3Model
    return seeded(spec, component, lambda: model_class(config))

"""Wan's transformer part: ``WanTransformer3DModel``, text-only cross-attentions shared by the rows of one text,
the timestep projection that modulates its blocks (TeaCache's signal), the first-last-frame image embedder's
row pairs, diffusers' context-parallel plan."""

from __future__ import annotations

from dataclasses import dataclass

from common.diffusion.parts.transformer import TransformerPart

IMAGE_HIDDEN = "encoder_hidden_states_image"  # the transformer's keyword for CLIP's image embeds


def clip(info) -> bool:
    """The model embeds its image with a CLIP vision encoder (Wan2.1 I2V: the transformer has image_dim)."""
    return info.transformer_config.get("image_dim") is not None


@dataclass(frozen=True, kw_only=True)
class WanTransformer(TransformerPart):
    model_class: str = "WanTransformer3DModel"
    block_list: str = "blocks"
    context_parallel: bool = True

    def forward(self, model, hidden_states, timestep, text, grid, guidance):
        image = text.get(IMAGE_HIDDEN)
        tokens = model.config.pos_embed_seq_len
        if image is not None and tokens:  # the first-last-frame embedder takes [2B, 257, D] (its rows' pairs)
            text = {**text, IMAGE_HIDDEN: image.reshape(-1, tokens // 2, image.shape[-1])}
        return model(hidden_states=hidden_states, timestep=timestep, return_dict=False, **text)[0]

    def modulated_input(self, model, timestep, text, guidance):
        embedder = model.condition_embedder
        t = embedder.timesteps_proj(timestep)
        temb = embedder.time_embedder(t.to(next(iter(embedder.time_embedder.parameters())).dtype))
        return embedder.time_proj(embedder.act_fn(temb))

    def shares_text(self, info) -> bool:
        # The text-only cross-attention processors do not cover CLIP's image keys and values.
        return not clip(info)

    def cross_attentions(self, model) -> list:
        # Image-conditioned (I2V) attention (its add_k_proj) keeps diffusers' processor.
        return [block.attn2 for block in model.blocks if block.attn2.add_k_proj is None]

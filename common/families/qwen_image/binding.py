"""Qwen-Image (``QwenImagePipeline``).

- encoder: Qwen2.5-VL's last hidden state of the prompt in diffusers' template, the template's prefix tokens
  dropped (:mod:`common.families.qwen_image.text`); a prompt travels as ``prompt_embeds`` [L, D], its own
  length (no padding);
- denoise: ``QwenImageTransformer2DModel`` on packed latents (:class:`~common.diffusion.parts.latents.PackedLatents`) with its
  ``img_shapes`` and the timestep / 1000; texts of different lengths in one forward are zero-padded with
  an ``encoder_hidden_states_mask``, as the pipeline batches prompts; true classifier-free guidance is
  ``true_cfg_scale`` with a negative prompt, two forwards and the pipeline's norm rescale;
- schedule: flow-match Euler with dynamic shifting (``mu`` from the image sequence length unless the request
  gives one), sigmas ``linspace(1, 1/N, N)`` stretched to the config's ``shift_terminal``;
- decode: ``AutoencoderKLQwenImage``, unpacked, de-normalised by the VAE's latents mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.guidance import TrueGuidance
from common.diffusion.parts.latents import Geometry, PackedLatents, vae_config
from common.diffusion.parts.text import HIDDEN, MaskedText, TextCond
from common.diffusion.parts.transformer import JOINT_ATTENTION_PROJECTIONS, TransformerPart
from common.diffusion.request_fields import TRUE_CFG_SCALE, max_sequence_length
from common.families.qwen_image.vae import QwenImageDecoder
from common.protocol.messages import PROMPT_EMBEDS

MASK = "encoder_hidden_states_mask"


def geometry(path, transformer_config: dict) -> Geometry:
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 64)) // 4,
                    vae_scale_spatial=2 ** len(vae_config(path).get("temperal_downsample", [False, True, True])),
                    patch_size=(2, 2))


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.qwen_image.text import QwenImageTextEncoder

    return QwenImageTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    width = model.config.joint_attention_dim
    return TextCond({HIDDEN: torch.randn(1, min(max_sequence_length, 16), width, generator=generator,
                                         device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class QwenImageTransformer(TransformerPart):
    model_class: str = "QwenImageTransformer2DModel"
    # Texts are their prompt's own length (padded and masked only in a forward of several): under --compile
    # the text length is dynamic, else every new prompt length compiles new graphs.
    compile_dynamic: dict[str, tuple[int, ...]] = field(default_factory=lambda: {HIDDEN: (1,), MASK: (1,)})
    context_parallel: bool = True  # QwenImageTransformer2DModel has a _cp_plan
    splits_text: bool = True  # its plan splits encoder_hidden_states
    # Both streams' attention projections (the recipes' LoRA targets for Qwen-Image).
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_PROJECTIONS

    def load(self, path: Path, dtype: torch.dtype, file: Path | None = None) -> torch.nn.Module:
        _trace_text_length_symbolically()
        return super().load(path, dtype, file)

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        # One img_shapes entry for every row: the transformer's rotary embedding reads only the first (all rows
        # are one size), and a list of one per row would make torch.compile guard on its length (a graph per
        # batch size).
        return model(hidden_states=hidden_states, timestep=timestep.to(hidden_states.dtype) / 1000,
                     guidance=guidance, encoder_hidden_states=text[HIDDEN], encoder_hidden_states_mask=text.get(MASK),
                     img_shapes=[[(1, *grid)]], return_dict=False)[0]

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json (the
    # built-in models carry one fitted on small-qwen-image-smooth; a real checkpoint: bench/fit_teacache.py MODEL_DIR --write).
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        dtype = text[HIDDEN].dtype  # (the embedding reads only the dtype of the hidden states it is given)
        t, like = timestep.to(dtype) / 1000, text[HIDDEN][:, :1]
        if guidance is None:
            return model.time_text_embed(t, like)
        return model.time_text_embed(t, guidance.to(dtype) * 1000, like)


QWEN_IMAGE = Binding(
    family="qwen-image", pipeline="QwenImagePipeline", words=("qwen",),
    # QwenImageTransformer2DModel's encoder_hidden_states_mask: texts of different lengths share a forward.
    text=MaskedText(fields=(PROMPT_EMBEDS,), keywords=(HIDDEN,), load_encoder=load_text_encoder,
                    example=example_text, mask=MASK),
    latents=PackedLatents(geometry=geometry), transformer=QwenImageTransformer(), decoder=QwenImageDecoder,
    guidance=TrueGuidance(rescale=True),  # true CFG rescaled to the conditional prediction's norm per token
    # QwenImagePipeline's own defaults. guidance_scale is the guidance-distilled models' embedded guidance
    # (their config's guidance_embeds); the others take none and refuse the field.
    defaults={"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 50, "guidance_scale": 1.0,
              "true_cfg_scale": 4.0, "max_sequence_length": 512},
    default_size=lambda tcfg, geometry: 128 * geometry.vae_scale_spatial,  # QwenImagePipeline.default_sample_size
    request_fields=(max_sequence_length(1024), TRUE_CFG_SCALE))  # 1024: QwenImagePipeline.check_inputs


_TRACED = False


def _trace_text_length_symbolically() -> None:
    """Under torch.compile, trace diffusers' ``compute_text_seq_len_from_mask`` as an equal function that keeps
    the text length symbolic (``compile_dynamic``): diffusers' own turns it into a tensor
    (``torch.as_tensor(text_seq_len)``), which fixes it, a graph per padded length of a masked forward.
    Eager forwards still run diffusers' function."""
    global _TRACED
    if _TRACED or not hasattr(torch.compiler, "substitute_in_graph"):  # torch < 2.5: graphs per length
        return
    from diffusers.models.transformers import transformer_qwenimage as qi

    @torch.compiler.substitute_in_graph(qi.compute_text_seq_len_from_mask)
    def compute_text_seq_len_from_mask(encoder_hidden_states, encoder_hidden_states_mask):
        batch_size, text_seq_len = encoder_hidden_states.shape[:2]
        if encoder_hidden_states_mask is None:
            return text_seq_len, None, None
        if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
            raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                             f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len}).")
        mask = encoder_hidden_states_mask.to(torch.bool)
        position_ids = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
        active_positions = torch.where(mask, position_ids, position_ids.new_zeros(()))
        per_sample_len = torch.where(mask.any(dim=1), active_positions.max(dim=1).values + 1,
                                     position_ids.new_full((), text_seq_len))
        return text_seq_len, per_sample_len, mask

    _TRACED = True

"""SANA (``SanaPipeline``).

- encoder: Gemma2 behind the pipeline's complex human instruction (prompts only; :mod:`.text`); a prompt travels
  as its real rows ``prompt_embeds`` [L, D] and is padded back to ``max_sequence_length`` with the attention
  mask the transformer takes (``encoder_attention_mask``), so texts of different lengths share a forward;
- denoise: ``SanaTransformer2DModel`` on latents [C, H / 32, W / 32] at the request's size snapped to the
  aspect-ratio bins of the transformer's ``sample_size`` (resolution binning), timestep x ``timestep_scale``;
  classifier-free guidance as one forward of [uncond, cond];
- schedule: the directory's ``DPMSolverMultistepScheduler`` (flow prediction, ``flow_shift``); rollouts: the
  engine's flow-match Euler with the same shift;
- decode: ``AutoencoderDC`` on ``latents / scaling_factor``, resized back to the requested size (:mod:`.vae`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.diffusion.binding import HIDDEN, Binding, Geometry, TextCond
from common.diffusion.vae_tiling import VaeTiling
from common.protocol.messages import PROMPT_EMBEDS

MASK = "encoder_attention_mask"


def aspect_ratio_bins(sample_size: int) -> dict:
    """``SanaPipeline.__call__``'s bins for a transformer ``sample_size``."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN
    from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN

    bins = {128: ASPECT_RATIO_4096_BIN, 64: ASPECT_RATIO_2048_BIN, 32: ASPECT_RATIO_1024_BIN, 16: ASPECT_RATIO_512_BIN}
    if sample_size not in bins:
        raise ValueError(f"SanaPipeline bins resolutions for a transformer sample_size of 16, 32, 64 or 128, "
                         f"not {sample_size}")
    return bins[sample_size]


def binned_size(info, height: int, width: int) -> tuple[int, int]:
    """The size the pipeline generates at for a requested one (``classify_height_width_bin``)."""
    from diffusers.image_processor import PixArtImageProcessor

    bins = aspect_ratio_bins(int(info.transformer_config.get("sample_size", 32)))
    return PixArtImageProcessor.classify_height_width_bin(height, width, ratios=bins)


class SanaBinding(Binding):
    family = "sana"
    pipeline = "SanaPipeline"
    video = False
    size_multiple = 32  # SanaPipeline.check_inputs (binning off; on, any size is snapped to a bin)
    # SanaPipeline.__call__'s own defaults.
    defaults = {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 20, "guidance_scale": 4.5,
                "max_sequence_length": 300}
    fields = frozenset({"max_sequence_length"})
    # The pipeline sets no bound; Gemma2's context holds the instruction and this many tokens with room to spare.
    max_sequence_length_limit = 1024
    text_fields = (PROMPT_EMBEDS,)
    masks_text_padding = True  # encoder_attention_mask (see stack_texts)
    guidance_in_one_forward = True  # the pipeline's [uncond, cond] batch

    def geometry(self, path: Path, transformer_config: dict) -> Geometry:
        vcfg = json.loads((path / "vae" / "config.json").read_text())
        p = int(transformer_config.get("patch_size", 1))
        return Geometry(latent_channels=int(transformer_config.get("in_channels", 32)),
                        vae_scale_spatial=2 ** (len(vcfg["encoder_block_out_channels"]) - 1), patch_size=(p, p))

    def latent_shape(self, info, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        h, w = binned_size(info, height, width)
        return (1, info.latent_channels, h // info.vae_scale_spatial, w // info.vae_scale_spatial)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> TextCond:
        embeds = wire[PROMPT_EMBEDS.name]
        padded = embeds.new_zeros((1, max_sequence_length, embeds.shape[-1]))
        padded[0, : embeds.shape[0]] = embeds
        mask = embeds.new_zeros((1, max_sequence_length))
        mask[0, : embeds.shape[0]] = 1
        return TextCond({HIDDEN: padded, MASK: mask})

    def stack_texts(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Texts of another ``max_sequence_length`` padded (and masked) to the longest."""
        longest = max(t[HIDDEN].shape[1] for t in texts)
        pad = torch.nn.functional.pad
        return {HIDDEN: torch.cat([pad(t[HIDDEN], (0, 0, 0, longest - t[HIDDEN].shape[1])) for t in texts]),
                MASK: torch.cat([pad(t[MASK], (0, longest - t[MASK].shape[1])) for t in texts])}

    def load_expert(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        from diffusers import SanaTransformer2DModel

        _register_block()
        return SanaTransformer2DModel.from_pretrained(path, dtype=dtype)

    def load_text_encoder(self, info, dtype: torch.dtype, device):
        from common.families.sana.text import SanaTextEncoder

        return SanaTextEncoder.load(info.path, dtype, device)

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        out = model(hidden_states, encoder_hidden_states=text[HIDDEN], encoder_attention_mask=text[MASK],
                    timestep=timestep * model.config.timestep_scale, return_dict=False)[0]
        if model.config.out_channels // 2 == model.config.in_channels:  # learned sigma: the pipeline drops it
            out = out.chunk(2, dim=1)[0]
        return out

    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        t = timestep * model.config.timestep_scale
        return model.time_embed(t, batch_size=t.shape[0], hidden_dtype=text[HIDDEN].dtype)[0]

    def example_text(self, info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
        width = model.config.caption_channels
        return TextCond({HIDDEN: torch.randn(1, max_sequence_length, width, generator=generator, device=device,
                                             dtype=dtype),
                         MASK: torch.ones(1, max_sequence_length, device=device, dtype=dtype)})

    def load_decoder(self, info, dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        from common.families.sana.vae import SanaDecoder

        return SanaDecoder.load(info, dtype, device, tiling)


def _register_block() -> None:
    """Tell diffusers' block registry (first-block caching reads it) that a SANA block returns the image stream
    alone: diffusers 0.42 registers no SANA block."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock

    try:
        TransformerBlockRegistry.get(SanaTransformerBlock)
    except ValueError:
        TransformerBlockRegistry.register(SanaTransformerBlock, TransformerBlockMetadata(return_hidden_states_index=0))

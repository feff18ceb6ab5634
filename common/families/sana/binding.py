"""SANA (``SanaPipeline``).

- encoder: Gemma2 behind the pipeline's complex human instruction (prompts only, so a negative prompt is
  encoded apart; :mod:`.text`); a prompt travels as its real rows ``prompt_embeds`` [L, D] and is padded back
  to ``max_sequence_length`` with the attention mask the transformer takes (``encoder_attention_mask``), so
  texts of different budgets share a forward;
- denoise: ``SanaTransformer2DModel`` on latents [C, H / 32, W / 32] made at the request's size snapped to the
  aspect-ratio bins of the transformer's ``sample_size`` (resolution binning, unless the request turns it off;
  then sizes are multiples of 32), timestep x ``timestep_scale``, a learned-sigma half dropped;
  classifier-free guidance as one forward of [uncond, cond];
- schedule: the directory's ``DPMSolverMultistepScheduler`` (flow prediction, ``flow_shift``); rollouts: the
  engine's flow-match Euler with the same shift;
- decode: ``AutoencoderDC`` on ``latents / scaling_factor``, resized back to the requested size (:mod:`.vae`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.guidance import Guidance
from common.diffusion.parts.latents import Geometry, LatentsPart, vae_config
from common.diffusion.parts.text import HIDDEN, PaddedMaskedText, TextCond
from common.diffusion.parts.transformer import TransformerPart
from common.diffusion.request_fields import RequestField, max_sequence_length
from common.families.sana.vae import SanaDecoder
from common.protocol.messages import PROMPT_EMBEDS

MASK = "encoder_attention_mask"
BINNING = "use_resolution_binning"


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


def geometry(path, transformer_config: dict) -> Geometry:
    p = int(transformer_config.get("patch_size", 1))
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 32)),
                    vae_scale_spatial=2 ** (len(vae_config(path)["encoder_block_out_channels"]) - 1),
                    patch_size=(p, p))


@dataclass(frozen=True, kw_only=True)
class BinnedLatents(LatentsPart):
    """Image latents made at the resolution bin of the requested size unless the request turns binning off."""

    snaps_sizes: bool = True

    def size(self, info, height: int, width: int, fields: dict) -> tuple[int, int]:
        return binned_size(info, height, width) if fields.get(BINNING, True) else (height, width)


def load_text_encoder(info, dtype: torch.dtype, device):
    from common.families.sana.text import SanaTextEncoder

    return SanaTextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    width = model.config.caption_channels
    return TextCond({HIDDEN: torch.randn(1, max_sequence_length, width, generator=generator, device=device,
                                         dtype=dtype),
                     MASK: torch.ones(1, max_sequence_length, device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class SanaTransformer(TransformerPart):
    model_class: str = "SanaTransformer2DModel"
    # Texts are padded to their request's budget: under --compile the text length is dynamic, else each
    # budget compiles its own graphs.
    compile_dynamic: dict[str, tuple[int, ...]] = field(default_factory=lambda: {HIDDEN: (1,), MASK: (1,)})

    def load(self, path: Path, dtype: torch.dtype, file: Path | None = None) -> torch.nn.Module:
        _register_block()
        return super().load(path, dtype, file)

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        out = model(hidden_states, encoder_hidden_states=text[HIDDEN], encoder_attention_mask=text[MASK],
                    timestep=timestep * model.config.timestep_scale, return_dict=False)[0]
        if model.config.out_channels // 2 == model.config.in_channels:  # learned sigma: the pipeline drops it
            out = out.chunk(2, dim=1)[0]
        return out

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json.
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        t = timestep * model.config.timestep_scale
        return model.time_embed(t, batch_size=t.shape[0], hidden_dtype=text[HIDDEN].dtype)[0]


def _refuse_clean_caption(value, request: dict):
    """The pipeline's caption cleaning (bs4 and ftfy) is not run by this engine: false (the pipeline's
    default) is what every request gets, true is refused rather than ignored."""
    if value:
        raise ValueError("clean_caption (the pipeline's caption cleaning) is not run by this engine; send the "
                         "prompt as it should be encoded, with clean_caption false or left out")
    return None


USE_RESOLUTION_BINNING = RequestField(
    BINNING, bool, "snap the size to the aspect-ratio bins of the transformer's sample_size and resize the image "
    "back (the pipeline's default); false: the requested size, a multiple of 32", default=True)
CLEAN_CAPTION = RequestField("clean_caption", bool, "the pipeline's caption cleaning: not run by this engine, "
                             "only false is taken", resolve=_refuse_clean_caption)

SANA = Binding(
    family="sana", pipeline="SanaPipeline", words=("sana",),
    text=PaddedMaskedText(fields=(PROMPT_EMBEDS,), load_encoder=load_text_encoder, example=example_text, mask=MASK),
    latents=BinnedLatents(geometry=geometry), transformer=SanaTransformer(), decoder=SanaDecoder,
    guidance=Guidance(in_one_forward=True, float32_output=True),  # the pipeline's [uncond, cond] batch
    size_multiple=32,  # SanaPipeline.check_inputs, on the size the latents are made at
    # SanaPipeline.__call__'s own defaults (height and width: the transformer's sample size x 32).
    defaults={"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 20, "guidance_scale": 4.5,
              "max_sequence_length": 300},
    default_size=lambda tcfg, geometry: int(tcfg.get("sample_size", 32)) * geometry.vae_scale_spatial,
    # The pipeline sets no bound; Gemma2's context holds the instruction and this many tokens with room to spare.
    request_fields=(max_sequence_length(1024), USE_RESOLUTION_BINNING, CLEAN_CAPTION))


def _register_block() -> None:
    """Tell diffusers' block registry (first-block caching reads it) that a SANA block returns the image stream
    alone: diffusers 0.42 registers no SANA block."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock

    try:
        TransformerBlockRegistry.get(SanaTransformerBlock)
    except ValueError:
        TransformerBlockRegistry.register(SanaTransformerBlock, TransformerBlockMetadata(return_hidden_states_index=0))

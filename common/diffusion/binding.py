"""What a model family binds: the one interface between a diffusers pipeline and the engine's stages.

A family is one diffusers pipeline class (``model_index.json``'s ``_class_name``). Its binding
(``common/families/<family>/``) says everything the stages, the router and a trainer must do
differently for it; everything else (rows, guidance, the SDE step, LoRA hooks, shared text, weight
buckets, compile, context parallel, tensor contracts) is shared and knows nothing of any family.

- **encoder worker**: :meth:`Binding.load_text_encoder`, whose ``wire_tensors`` gives each prompt's
  wire tensors (named by :attr:`Binding.text_fields`);
- **denoise worker**: :meth:`Binding.load_expert` per expert, :meth:`Binding.conditioning` (the wire
  tensors as the transformer takes them), :meth:`Binding.forward` (the transformer's call on batched
  rows), :meth:`Binding.latent_shape`;
- **decode worker**: :meth:`Binding.load_decoder` (latents to frames ``[n, F, H, W, 3]`` in [0, 1]);
- **router**: :attr:`Binding.defaults` (the pipeline's own), :attr:`Binding.fields` (the optional
  request fields it takes), :attr:`Binding.size_multiple`, :attr:`Binding.video`.

Latents are what the family's pipeline steps on: ``[C, F', H', W']`` (Wan), ``[C, H', W']`` (SD3), or
packed tokens ``[seq, C * 4]`` (FLUX, Qwen-Image), drawn as :meth:`Binding.noise_shape` and packed
by :meth:`Binding.pack`; the decoder unpacks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.protocol.messages import TensorField

if TYPE_CHECKING:
    from common.diffusion.model_info import ModelInfo

HIDDEN = "encoder_hidden_states"  # the text sequence every family's transformer takes under this name


@dataclass(frozen=True, eq=False)  # identity: the same object on two rows is one text (see rows.Rows.of)
class TextCond:
    """One text's conditioning as the transformer takes it: its keyword -> a [1, ...] tensor."""

    tensors: dict[str, torch.Tensor]


# A single tensor means encoder_hidden_states alone (Wan's only text input).
Conditioning = Union[torch.Tensor, TextCond]


def text_kwargs(cond: Conditioning) -> dict[str, torch.Tensor]:
    return {HIDDEN: cond} if isinstance(cond, torch.Tensor) else cond.tensors


def cond_to(cond: Conditioning, device, dtype: torch.dtype) -> Conditioning:
    """``cond`` on ``device`` in ``dtype`` (a new object when anything moves)."""
    if isinstance(cond, torch.Tensor):
        return cond.to(device, dtype)
    return TextCond({k: v.to(device, dtype) for k, v in cond.tensors.items()})


@dataclass(frozen=True)
class Geometry:
    """What a model directory says about its latents: read once by the family (:meth:`Binding.geometry`)."""

    latent_channels: int
    vae_scale_spatial: int
    vae_scale_temporal: int = 1  # 1: an image family
    patch_size: tuple[int, ...] = (1, 2, 2)


class Binding:
    """A model family: subclass it once per diffusers pipeline (see the module docstring)."""

    family: str  # short name: /health, /v1/models, the launcher's table
    pipeline: str  # model_index.json's _class_name
    video: bool  # frames [F, H, W, 3] with F from num_frames; else one frame (an image)
    size_multiple: int = 16
    # The pipeline's own defaults for the request fields a model directory's serving defaults may override.
    defaults: dict = {}
    max_sequence_length_limit: int = 512
    # Optional request fields this family takes (beyond prompt, sizes, steps, guidance, seed, n, ...).
    fields: frozenset[str] = frozenset()
    # A prompt's wire tensors (their negative-prompt twins are messages.NEGATIVE_OF[field.name]).
    text_fields: tuple[TensorField, ...] = ()
    # Text-only activations computed once per distinct text (common/diffusion/shared_text.py): Wan's
    # cross-attention; not a joint-attention model, whose text stream depends on the latents.
    shares_text: bool = False
    # Dimensions of the transformer's tensor keywords (besides the batch) that vary between requests of one
    # latent shape: ``compile_experts`` makes them dynamic, one graph for every value (Qwen-Image's text
    # length, each prompt's own); every other dimension is static (fixed-length texts: a graph each).
    compile_dynamic: dict[str, tuple[int, ...]] = {}
    # diffusers has a context-parallel plan for the transformer (Ulysses / ring).
    context_parallel: bool = False
    # A single request's guidance as diffusers runs it: both halves in one forward ([uncond, cond]), or
    # two forwards (cond, then uncond).
    guidance_in_one_forward: bool = False
    fps: int = 16  # video families: the MP4's frame rate unless serving_defaults.json says otherwise
    # A trainer's default LoRA target modules (``rl.lora.add_lora``, peft's ``target_modules``: suffixes of the
    # transformer's Linear paths): the attention projections unless the family's training recipes say otherwise.
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")

    # The request field that scales classifier-free guidance: ``guidance_scale`` (Wan, SD3), or
    # ``true_cfg_scale`` (FLUX, Qwen-Image, whose ``guidance_scale`` is the transformer's embedded guidance).
    cfg_field: str = "guidance_scale"
    # The pipeline hands its scheduler ``sigmas = linspace(1, 1/N, N)`` when a request gives none (FLUX,
    # Qwen-Image); else the scheduler spaces its own steps.
    default_sigmas: bool = False

    def geometry(self, path: Path, transformer_config: dict) -> Geometry:
        raise NotImplementedError

    def shares_text_for(self, info: "ModelInfo") -> bool:
        """:attr:`shares_text` for this model directory (some of a family's models cannot)."""
        return self.shares_text

    def cfg_scale(self, params) -> float:
        """The request's classifier-free guidance scale (guidance runs above 1)."""
        value = getattr(params, self.cfg_field)
        return 1.0 if value is None else float(value)

    def embedded_guidance(self, info: "ModelInfo", guidance_scale: float) -> float | None:
        """The transformer's guidance-embedding input for a request's ``guidance_scale`` (guidance-distilled
        models: their config's ``guidance_embeds``), else None."""
        return None

    def guide(self, cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Classifier-free guidance of one request's two passes, in its pipeline's order of operations."""
        return uncond + scale * (cond - uncond)

    def noise_shape(self, info: "ModelInfo", height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """One sample's initial noise as the pipeline draws it, before :meth:`pack` (leading 1)."""
        return self.latent_shape(info, height, width, num_frames)

    def pack(self, noise: torch.Tensor, info: "ModelInfo", height: int, width: int) -> torch.Tensor:
        """Drawn noise [n, *noise_shape] as the latents the pipeline steps on (identity: not packed)."""
        return noise

    def token_grid(self, info: "ModelInfo", height: int, width: int) -> tuple[int, int]:
        """Packed families: the (rows, columns) of a size's image tokens, which their position ids need."""
        return (0, 0)

    def image_seq_len(self, info: "ModelInfo", height: int, width: int, num_frames: int = 1) -> int:
        """The transformer's image tokens for a size (the dynamic shift's ``mu`` depends on it)."""
        shape = self.latent_shape(info, height, width, num_frames)
        return math.prod(n // p for n, p in zip(shape[2:], info.patch_size))

    # The transformer takes a mask over a text's padding tokens that leaves each row's output what it is alone
    # (``stack_texts`` pads and masks: Qwen-Image's ``encoder_hidden_states_mask``), so texts of different
    # lengths share a forward. diffusers' Wan, SD3 and FLUX transformers take none: a text's length is part of
    # what it says (Wan's zero padding and the T5 padding tokens are attended), so their rows share a forward
    # only with texts of the same shapes (:meth:`text_key`).
    masks_text_padding: bool = False

    def stack_texts(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Distinct texts' keyword tensors ([1, ...] each) as one [U, ...] tensor per keyword."""
        return {k: torch.cat([t[k] for t in texts]) for k in texts[0]}

    def text_key(self, texts: list[Conditioning]) -> tuple:
        """What a request's texts (its prompt's and negative prompt's conditioning) must have in common with
        those of the other requests of a forward: each keyword's shape, unless the transformer masks padding."""
        if self.masks_text_padding:
            return ()
        return tuple(sorted({(k, tuple(v.shape[1:])) for t in texts for k, v in text_kwargs(t).items()}))

    def pipeline_defaults(self, transformer_config: dict, geometry: Geometry) -> dict:
        """The pipeline's defaults for this directory (some depend on its config, e.g. SD3's sample size)."""
        return dict(self.defaults)

    def latent_shape(self, info: "ModelInfo", height: int, width: int, num_frames: int) -> tuple[int, ...]:
        """One sample's initial noise shape, as the family's pipeline draws it (leading 1)."""
        raise NotImplementedError

    def load_expert(self, path: Path, dtype: torch.dtype) -> torch.nn.Module:
        raise NotImplementedError

    def load_text_encoder(self, info: "ModelInfo", dtype: torch.dtype, device):
        """An object whose ``wire_tensors(prompts, max_sequence_length)`` gives, per prompt, its wire
        tensors ``{field.name: tensor}`` for :attr:`text_fields` (one encoder call for them all)."""
        raise NotImplementedError

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> Conditioning:
        """A prompt's wire tensors (cond names) as the transformer takes them, on the wire's device and dtype."""
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor,
                text: dict[str, torch.Tensor], grid: tuple[int, int], guidance: torch.Tensor | None) -> torch.Tensor:
        """The transformer's output for batched rows of one size (``grid``: :meth:`token_grid`); ``text``:
        each keyword's [B, ...] tensor; ``guidance``: the rows' embedded guidance [B] (or None)."""
        return model(hidden_states=hidden_states, timestep=timestep, return_dict=False, **text)[0]

    # --- step caching (common/diffusion/step_cache.py) -----------------------------------------------------
    # TeaCache's published polynomial (highest power first) from the relative change of
    # :meth:`modulated_input` between steps to that of the output, where one exists, and where it comes from
    # (None: none is published; a model directory then needs its own step_cache.json, as bench/fit_teacache.py
    # writes it, which overrides both); the steps it always computes first. common/diffusion/cache_signals.py.
    teacache_coefficients: tuple[float, ...] | None = None
    teacache_source: str | None = None
    teacache_warmup: int = 1

    def modulated_input(self, model: torch.nn.Module, timestep: torch.Tensor, text: dict[str, torch.Tensor],
                        guidance: torch.Tensor | None) -> torch.Tensor:
        """The timestep embedding that modulates the transformer's blocks, [B, ...], for rows' timesteps [B]
        (as :meth:`forward` takes them), text keywords [B, ...] and embedded guidance [B] (or None)."""
        raise NotImplementedError

    def example_text(self, info: "ModelInfo", model: torch.nn.Module, max_sequence_length: int,
                     generator: torch.Generator, device, dtype: torch.dtype) -> Conditioning:
        """A random conditioning of the right shapes for this model directory (compile warm-ups)."""
        raise NotImplementedError

    # --- image-to-video: a request's image(s), through the encoder worker's image side -----------------------
    # The tensors the image side sends the denoise worker (their names: common.protocol.messages).
    image_fields: tuple[TensorField, ...] = ()
    # Those of them the transformer takes beside the text (cross-attention: image embeds); they join each
    # prompt's conditioning (:meth:`conditioning`), the rest the latent side (:meth:`image_conditioning`).
    image_text_fields: frozenset[str] = frozenset()

    def image_input(self, info: "ModelInfo") -> str | None:
        """Whether a request's ``image`` is ``"required"``, ``"optional"`` or refused (None) on this model."""
        return None

    def fixed_max_sequence_length(self, info: "ModelInfo") -> int | None:
        """The only text length this model directory's transformer takes (None: any within the limit)."""
        return None

    def last_image_input(self, info: "ModelInfo") -> str | None:
        """Whether a request's ``last_image`` (first-last-frame conditioning) is ``"required"``, ``"optional"``
        or refused (None) on this model."""
        return None

    def load_image_conditioner(self, info: "ModelInfo", dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        """An object whose ``wire_tensors(image, last_image, height, width, num_frames)`` gives a request's
        image tensors (PIL images in; ``last_image`` may be None); its VAE encode tiles as ``tiling`` says."""
        raise NotImplementedError

    def image_conditioning(self, wire: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The latent-side condition of a request's image wire tensors ([1, ...]), or None (text only)."""
        return None

    def example_image(self, info: "ModelInfo", latent_shape: tuple[int, ...], generator: torch.Generator, device,
                      dtype: torch.dtype) -> torch.Tensor | None:
        """A random image condition of the right shape for latents ``latent_shape`` (compile warm-ups), or None
        when the model's requests need none."""
        return None

    def model_latents(self, info: "ModelInfo", latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """The transformer's ``hidden_states`` from a request's latents [n, ...] and its image condition."""
        return latents

    def row_timesteps(self, info: "ModelInfo", timestep: torch.Tensor, latents: torch.Tensor,
                      image: torch.Tensor | None) -> torch.Tensor:
        """A request's timestep for each of its n rows: [n] float32 (per-token models: [n, tokens])."""
        return (timestep.expand(latents.shape[0]) if timestep.dim() == 0 else timestep).float()

    def final_latents(self, info: "ModelInfo", latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """A request's latents after its last step, as its pipeline returns them (e.g. frame 0 put back)."""
        return latents

    def log_prob_mask(self, info: "ModelInfo", latents: torch.Tensor, image: torch.Tensor | None):
        """Which latent elements a rollout's log-prob averages over (broadcastable to the latents), or None:
        all of them."""
        return None

    def load_decoder(self, info: "ModelInfo", dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        """An object whose ``decode(latents, height, width)`` gives float32 frames [n, F, H, W, 3] in [0, 1],
        its VAE tiled as ``tiling`` says for the samples' size."""
        raise NotImplementedError

"""The condition part: a request's image(s), sent by the encoder worker's image side, and what they do to the
latents the transformer sees.

- :class:`NoCondition`: text only;
- :class:`FirstFrame`: frame 0 from the image's latent (``image_condition`` [C, 1, H', W']) in every model
  input and in the result, its tokens' timestep 0 (a timestep per token); a rollout's frame 0 is then no
  Gaussian step, so its elements are left out of the log-probs. Only on models whose ``model_index.json``
  says ``expand_timesteps``; the image is optional;
- :class:`ChannelConcat`: the condition (``image_condition``: a mask and the image's latents) concatenated
  to the latents on the channel axis, a constant of the request (the rollout's step is the text-only one's,
  trajectories carry the noise latents only); the image is required (optional on ``expand_timesteps`` models,
  taken as :class:`FirstFrame` does), image embeds (``image_embeds``) may join the text side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from common.diffusion.vae_tiling import VaeTiling
from common.protocol.tensor_field import FLOAT_DTYPES, TensorField, image_tensor

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

# What an image side sends the denoise worker: the condition latents, [4 + C, F', H', W'] (a mask and the image's
# latents, concatenated to the noise) or [C, 1, H', W'] (frame 0's latent), and an image encoder's embeds
# [k, tokens, D] (one per image) that join the text side.
IMAGE_CONDITION = image_tensor("image_condition", FLOAT_DTYPES, 4)
IMAGE_EMBEDS = image_tensor("image_embeds", FLOAT_DTYPES, 3)

# (info, dtype, device, tiling) -> an object whose wire_tensors(image, last_image, height, width, num_frames)
# gives a request's image tensors (PIL images in; last_image may be None).
ConditionerLoader = Callable[["ModelFacts", torch.dtype, Any, VaeTiling], Any]


@dataclass(frozen=True, kw_only=True)
class NoCondition:
    fields: tuple[TensorField, ...] = ()  # the tensors the image side sends the denoise worker
    # Those of them the transformer takes beside the text (they join each prompt's conditioning).
    text_fields: frozenset[str] = frozenset()

    def image_input(self, info: "ModelFacts") -> str | None:
        """Whether a request's ``image`` is ``"required"``, ``"optional"`` or refused (None) on this model."""
        return None

    def last_image_input(self, info: "ModelFacts") -> str | None:
        """The same for ``last_image`` (first-last-frame conditioning)."""
        return None

    def images_allowed(self, info: "ModelFacts") -> int:
        """How many images ``image`` may hold (a list beyond one: image editing with several references)."""
        return 0 if self.image_input(info) is None else 1

    def text_sees_images(self) -> bool:
        """Whether the text encoder takes the request's images too (a vision-language encoder)."""
        return False

    def load(self, info: "ModelFacts", dtype: torch.dtype, device, tiling: VaeTiling = VaeTiling()):
        """The image side's conditioner (its VAE encode tiles as ``tiling`` says)."""
        raise NotImplementedError("this model takes no image")

    def wire_tensors(self, conditioner, images: list, last_image, params) -> dict[str, torch.Tensor]:
        """A request's image tensors for the denoise worker from its PIL images (``images``: ``image``, or its
        list; ``last_image`` or None) and its ``GenerationParams``, by the loaded ``conditioner``."""
        return conditioner.wire_tensors(images[0], last_image, params.height, params.width, params.num_frames)

    def cache_key(self, params) -> tuple:
        """What of ``params`` an image's tensors depend on (the encoder worker's cache key, beside the pixels)."""
        return params.height, params.width, params.num_frames

    def default_size(self, info: "ModelFacts", sizes: list[tuple[int, int]], fields: dict) -> tuple[int, int] | None:
        """The output's (height, width) a request without them gets from its images' (width, height), or None:
        the model's defaults."""
        return None

    def from_wire(self, wire: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The latent-side condition of a request's image wire tensors ([1, ...]), or None (text only)."""
        return None

    def example(self, info: "ModelFacts", latent_shape: tuple[int, ...], generator: torch.Generator, device,
                dtype: torch.dtype) -> torch.Tensor | None:
        """A random condition of the right shape for latents ``latent_shape`` (compile warm-ups), or None."""
        return None

    def model_latents(self, info: "ModelFacts", latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """The transformer's ``hidden_states`` from a request's latents [n, ...] and its condition."""
        return latents

    def token_layout(self, grid: tuple[int, int], image):
        """What the transformer part gets as ``grid`` for a request with this condition: the latents' token grid,
        or with reference images a :class:`~common.diffusion.parts.reference.TokenLayout`."""
        return grid

    def batch_key(self, image):
        """What rows of one forward must share besides their size (None: nothing)."""
        return None

    def extra_tokens(self, image) -> int:
        """The tokens a request's condition adds to the transformer's image sequence (reference images)."""
        return 0

    def row_timesteps(self, info: "ModelFacts", timestep: torch.Tensor, latents: torch.Tensor,
                      image: torch.Tensor | None) -> torch.Tensor:
        """A request's timestep for each of its n rows: [n] float32 (per-token models: [n, tokens])."""
        return (timestep.expand(latents.shape[0]) if timestep.dim() == 0 else timestep).float()

    def final_latents(self, info: "ModelFacts", latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
        """A request's latents after its last step, as its pipeline returns them."""
        return latents

    def log_prob_mask(self, info: "ModelFacts", latents: torch.Tensor, image: torch.Tensor | None):
        """Which latent elements a rollout's log-prob averages over (broadcastable), or None: all of them."""
        return None


def frame_mask(latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """[1, 1, F', H', W'] float32: 0 on frame 0 when an image gives it, else 1 (diffusers' first_frame_mask)."""
    mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=latents.device)
    if image is not None:
        mask[:, :, 0] = 0
    return mask


@dataclass(frozen=True, kw_only=True)
class FirstFrame(NoCondition):
    """Frame 0 from an image's latent, a timestep per token (see the module docstring)."""

    loader: ConditionerLoader | None = None
    fields: tuple[TensorField, ...] = (IMAGE_CONDITION,)

    def image_input(self, info):
        return "optional" if info.expand_timesteps else None

    def load(self, info, dtype, device, tiling=VaeTiling()):
        return self.loader(info, dtype, device, tiling)

    def from_wire(self, wire):
        c = wire.get(IMAGE_CONDITION.name)
        return None if c is None else c[None]

    def example(self, info, latent_shape, generator, device, dtype):
        if not info.expand_timesteps:
            return None
        c, _, h, w = latent_shape  # frame 0's latent: an image's requests (the same graph as text-only ones')
        return torch.randn(1, c, 1, h, w, generator=generator, device=device, dtype=dtype)

    def model_latents(self, info, latents, image):
        return _frame0_from(info, latents, image)

    def row_timesteps(self, info, timestep, latents, image):
        if not info.expand_timesteps:
            return super().row_timesteps(info, timestep, latents, image)
        # One per token of the patched grid: the mask at the patches' corners, times t (0 on an image's frame 0).
        _, ph, pw = info.patch_size
        corners = frame_mask(latents, image)[0, 0][:, ::ph, ::pw].flatten()
        return (corners * timestep.float().reshape(-1, 1)).expand(latents.shape[0], -1)

    def final_latents(self, info, latents, image):
        return _frame0_from(info, latents, image)

    def log_prob_mask(self, info, latents, image):
        if image is None or not info.expand_timesteps:
            return None
        return frame_mask(latents, image)[:, :, :, :1, :1]  # [1, 1, F', 1, 1]: frame 0 left out


def _frame0_from(info, latents: torch.Tensor, image: torch.Tensor | None) -> torch.Tensor:
    """``latents`` with frame 0 replaced by the image's latent (expand_timesteps models given an image)."""
    if image is None or not info.expand_timesteps:
        return latents
    mask = frame_mask(latents, image)
    return (1 - mask) * image + mask * latents


@dataclass(frozen=True, kw_only=True)
class ChannelConcat(FirstFrame):
    """The condition concatenated on the channel axis (see the module docstring); ``expand_timesteps`` models
    take the image as :class:`FirstFrame` does."""

    # (info) -> whether a last image is "required", "optional" or refused (None), where the model says.
    last_image: Callable[["ModelFacts"], str | None] = lambda info: None

    def image_input(self, info):
        # expand_timesteps models: text to video without one, as the text-only pipeline runs the same directory.
        return "optional" if info.expand_timesteps else "required"

    def last_image_input(self, info):
        return None if info.expand_timesteps else self.last_image(info)  # (frame 0 alone there)

    def model_latents(self, info, latents, image):
        if info.expand_timesteps:
            return super().model_latents(info, latents, image)
        return torch.cat([latents, image.to(latents.dtype).expand(latents.shape[0], *image.shape[1:])], dim=1)

    def example(self, info, latent_shape, generator, device, dtype):
        if info.expand_timesteps:
            return super().example(info, latent_shape, generator, device, dtype)
        channels = info.transformer_config["in_channels"] - latent_shape[0]  # the mask's and the image's
        return torch.randn(1, channels, *latent_shape[1:], generator=generator, device=device, dtype=dtype)

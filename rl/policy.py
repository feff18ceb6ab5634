"""The trainer's side of a rollout: its own copy of the policy, in-process.

:class:`TrainerPolicy` loads the text encoder(s) and the transformer(s) from the
same model directory the engine serves, whatever its family, and recomputes the
log-probs of a returned trajectory with the engine's own code: the family's
binding (text encoding, the transformer's call), :class:`common.diffusion.policy.Policy`
(expert choice, guidance) and :func:`common.diffusion.policy.step_at` (the SDE step on
the schedule), so that rollout and recompute agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from common.diffusion.parts.text import Conditioning, cond_to
from common.diffusion.policy import ModelInput, Policy, step_at, uses_guidance
from common.diffusion.step_variants import step_variant
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.runtime.component_memory import settle_held


@dataclass
class Trajectory:
    """What ``/rollout/generate`` returns per sample with ``return_trajectory``."""

    latents: torch.Tensor  # [T+1, *latent]: x_0 (initial noise) ... x_T
    timesteps: torch.Tensor  # [T]
    sigmas: torch.Tensor  # [T+1]

    @classmethod
    def from_sample(cls, sample: dict) -> "Trajectory":
        tr = sample["trajectory"]
        return cls(tr["latents"], tr["timesteps"], tr["sigmas"])


@dataclass
class ImageInputs:
    """An image-to-video request's image as the encoder worker turns it into tensors (:meth:`TrainerPolicy.image`):
    ``wire`` what travels to the denoise worker, ``condition`` the latent side on the trainer's device."""

    wire: dict[str, torch.Tensor]
    condition: torch.Tensor | None


class TrainerPolicy:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 vae_tiling: VaeTiling = VaeTiling()):
        """``vae_tiling``: the engine's ``--vae-tiling`` settings, which an image's VAE encode follows (a tiled
        encode's condition differs from a whole one's)."""
        self.info = read_model(model_dir)
        self.vae_tiling = vae_tiling
        self.device = torch.device(device)
        self.dtype = dtype
        self.family = self.info.family
        self.text_encoder = self.family.text.load_encoder(self.info, dtype, self.device)
        settle_held(text_encoder=self.text_encoder)  # as the encoder worker's lies: the same embeddings
        self.policy = Policy.load(self.info, dtype, self.device, trainable=True)
        self._images = None  # the image side, loaded by the first image()

    def image(self, image, last_image=None, height: int | None = None, width: int | None = None,
              num_frames: int | None = None) -> ImageInputs:
        """An image-to-video request's image tensors, as the encoder worker makes them: ``image`` and
        ``last_image`` are PIL images or uint8 [H, W, 3] RGB pixels (what the router decodes from the request's
        base64); the size and frames left out take the model's defaults, as a request does."""
        from common.protocol.images import image_from_array

        if self._images is None:
            self._images = self.family.condition.load(self.info, self.dtype, self.device, self.vae_tiling)
            settle_held(images=self._images)
        d = self.info.defaults

        def pil(x):
            return None if x is None or hasattr(x, "convert") else image_from_array(x)

        first = pil(image) or image
        last = pil(last_image) or last_image
        with torch.no_grad():
            wire = self._images.wire_tensors(first, last, height or d["height"], width or d["width"],
                                             num_frames or d["num_frames"])
        condition = self.family.condition.from_wire(wire)
        return ImageInputs(wire, None if condition is None else condition.to(self.device))

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        return self.policy.experts

    @property
    def transformer(self) -> torch.nn.Module:
        return self.policy.experts["transformer"]

    def embeddings(self, prompt: str, negative_prompt: str, guidance_scale: float,
                   max_sequence_length: int | None = None,
                   image: ImageInputs | None = None) -> tuple[Conditioning, Conditioning | None]:
        """(cond, uncond) conditioning, exactly as the encoder + denoise workers build it (uncond None: no
        guidance, i.e. ``guidance_scale``, the classifier-free one (:meth:`cfg_scale`), at most 1);
        ``max_sequence_length`` left out takes the model's default, as a request does; ``image``: an
        image-to-video request's (its image embeds join each prompt's conditioning)."""
        length = max_sequence_length or self.info.defaults["max_sequence_length"]
        texts = [prompt, negative_prompt] if uses_guidance(guidance_scale) else [prompt]
        beside = {} if image is None else {k: t for k, t in image.wire.items() if k in self.family.condition.text_fields}
        conds = [cond_to(self.family.text.conditioning({**w, **beside}, length), self.device, self.policy.dtype)
                 for w in self.text_encoder.wire_tensors(texts, length)]
        return conds[0], conds[1] if len(conds) > 1 else None

    def velocity(self, latents, t, cond, uncond, guidance_scale, guidance_scale_2=None, *,
                 true_cfg_scale: float | None = None, height: int | None = None,
                 width: int | None = None, image: ImageInputs | None = None) -> torch.Tensor:
        """The guided velocity as the denoise worker computes it for a request with these fields (``height``
        and ``width`` left out: the model's defaults; packed families need them for their position ids;
        ``image``: an image-to-video request's, from :meth:`image`)."""
        d = self.info.defaults
        fields = SimpleNamespace(guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale)
        grid = self.family.latents.token_grid(self.info, height or d["height"], width or d["width"])
        x = ModelInput(latents.to(self.device), t.to(self.device), cond, uncond, self.family.guidance.scale(fields),
                       guidance_scale_2, grid=grid, embedded_guidance=self.family.guidance.embedded(
                           self.info, guidance_scale), image=None if image is None else image.condition)
        return self.policy.velocity(x)

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float | None = None) -> float:
        """The classifier-free guidance scale of a request's fields (FLUX, Qwen-Image: ``true_cfg_scale``)."""
        return self.family.guidance.scale(SimpleNamespace(guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale))

    def log_probs(
        self,
        trajectory: Trajectory,
        steps: list[int] | torch.Tensor,
        prompt: str,
        negative_prompt: str = "",
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        sde_type: str = "sde",
        noise_level: float = 0.7,
        embeddings=None,
        max_sequence_length: int | None = None,
        true_cfg_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        image: ImageInputs | None = None,
    ) -> torch.Tensor:
        """Recompute log p(x_{i+1} | x_i) for each step i in ``steps``: [K] float32, for a request with
        these fields (those left out: the model's defaults, as a request; ``image``: an image-to-video
        request's, from :meth:`image`, which also says which latent elements count: TI2V's frame 0 does not).

        Differentiable w.r.t. the transformer's parameters unless called under
        ``torch.no_grad()``.
        """
        cfg = self.cfg_scale(guidance_scale, true_cfg_scale)
        cond, uncond = embeddings or self.embeddings(prompt, negative_prompt, cfg, max_sequence_length, image)
        condition = None if image is None else image.condition
        out = []
        for i in [int(i) for i in steps]:
            x = trajectory.latents[i : i + 1].to(self.device)
            v = self.velocity(x, trajectory.timesteps[i], cond, uncond, guidance_scale, guidance_scale_2,
                              true_cfg_scale=true_cfg_scale, height=height, width=width, image=image)
            step = step_at(trajectory.sigmas, i, v, x, step_variant(sde_type, noise_level),
                           prev_sample=trajectory.latents[i + 1 : i + 2].to(self.device),
                           log_prob_mask=self.family.condition.log_prob_mask(self.info, x, condition))
            out.append(step.log_prob[0])
        return torch.stack(out) if out else torch.zeros(0)

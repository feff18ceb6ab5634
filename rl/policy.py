"""The trainer's side of a rollout: its own copy of the policy, in-process.

:class:`TrainerPolicy` loads the text encoder and the transformer(s) from the
same model directory the engine serves and recomputes the log-probs of a
returned trajectory with the engine's own code: :class:`common.diffusion.policy.WanPolicy`
(expert choice, guidance) and :func:`common.diffusion.policy.step_at` (the SDE step on
the schedule), so that rollout and recompute agree to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from common.diffusion.model_info import ModelInfo
from common.diffusion.policy import ModelInput, WanPolicy, step_at, uses_guidance
from common.families.wan.text import WanTextEncoder, conditioning


@dataclass
class Trajectory:
    """What ``/rollout/generate`` returns per sample with ``return_trajectory``."""

    latents: torch.Tensor  # [T+1, C, F', H', W']: x_0 (initial noise) ... x_T
    timesteps: torch.Tensor  # [T]
    sigmas: torch.Tensor  # [T+1]

    @classmethod
    def from_sample(cls, sample: dict) -> "Trajectory":
        tr = sample["trajectory"]
        return cls(tr["latents"], tr["timesteps"], tr["sigmas"])


class TrainerPolicy:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.info = ModelInfo.read(model_dir)
        self.device = torch.device(device)
        self.text_encoder = WanTextEncoder.load(self.info.path, dtype, self.device)
        self.policy = WanPolicy.load(self.info, dtype, self.device, trainable=True)

    @property
    def experts(self) -> dict[str, WanTransformer3DModel]:
        return self.policy.experts

    @property
    def transformer(self) -> WanTransformer3DModel:
        return self.policy.experts["transformer"]

    def embeddings(self, prompt: str, negative_prompt: str, guidance_scale: float):
        """Padded (cond, uncond) embeddings, exactly as the encoder + denoise workers build them."""
        negative = self.text_encoder.encode_one(negative_prompt) if uses_guidance(guidance_scale) else None
        return conditioning(self.text_encoder.encode_one(prompt), negative, self.device, self.policy.dtype)

    def velocity(self, latents, t, cond, uncond, guidance_scale, guidance_scale_2=None) -> torch.Tensor:
        x = ModelInput(latents.to(self.device), t.to(self.device), cond, uncond, guidance_scale, guidance_scale_2)
        return self.policy.velocity(x)

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
    ) -> torch.Tensor:
        """Recompute log p(x_{i+1} | x_i) for each step i in ``steps``: [K] float32.

        Differentiable w.r.t. the transformer's parameters unless called under
        ``torch.no_grad()``.
        """
        cond, uncond = embeddings or self.embeddings(prompt, negative_prompt, guidance_scale)
        out = []
        for i in [int(i) for i in steps]:
            x = trajectory.latents[i : i + 1].to(self.device)
            v = self.velocity(x, trajectory.timesteps[i], cond, uncond, guidance_scale, guidance_scale_2)
            step = step_at(trajectory.sigmas, i, v, x, sde_type=sde_type, noise_level=noise_level,
                           prev_sample=trajectory.latents[i + 1 : i + 2].to(self.device))
            out.append(step.log_prob[0])
        return torch.stack(out) if out else torch.zeros(0)

"""The trainer's side of a rollout: its own copy of the policy, in-process.

:class:`TrainerPolicy` loads the text encoder and the transformer(s) from the
same model directory the engine serves, and recomputes the log-probs of a
returned trajectory with the very functions the denoise worker used
(:func:`common.wan.policy.guided_velocity` and :func:`common.wan.sde.sde_step`), so
that rollout and recompute agree to float32 rounding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from common.wan.policy import expert_for_timestep, guidance_for, guided_velocity, pad_embeddings
from common.wan.model_info import ModelInfo
from common.wan.sde import sde_step
from encoder_worker.stage import encode_prompt, load_text_encoder


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
        self.tokenizer, self.text_encoder = load_text_encoder(self.info.path, dtype, self.device)
        self.experts: dict[str, WanTransformer3DModel] = {}
        for name in ("transformer", "transformer_2") if self.info.has_transformer_2 else ("transformer",):
            model = WanTransformer3DModel.from_pretrained(self.info.path / name, dtype=dtype)
            self.experts[name] = model.to(self.device).eval()
        sched = json.loads((self.info.path / "scheduler" / "scheduler_config.json").read_text())
        self.n_train = int(sched.get("num_train_timesteps", 1000))

    @property
    def transformer(self) -> WanTransformer3DModel:
        return self.experts["transformer"]

    def embeddings(self, prompt: str, negative_prompt: str, guidance_scale: float):
        """Padded (cond, uncond) embeddings, exactly as the encoder + denoise workers build them."""
        dtype = self.transformer.dtype
        cond = pad_embeddings(encode_prompt(self.tokenizer, self.text_encoder, prompt)).to(self.device, dtype)
        uncond = None
        if guidance_scale > 1.0:
            neg = encode_prompt(self.tokenizer, self.text_encoder, negative_prompt)
            uncond = pad_embeddings(neg).to(self.device, dtype)
        return cond, uncond

    def velocity(self, latents, t, cond, uncond, guidance_scale, guidance_scale_2=None) -> torch.Tensor:
        name = expert_for_timestep(t, self.info.boundary_ratio, self.n_train, "transformer_2" in self.experts)
        scale = guidance_for(name, guidance_scale, guidance_scale_2)
        return guided_velocity(self.experts[name], latents.to(self.device), t.to(self.device), cond, uncond, scale)

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
        sig = trajectory.sigmas
        s_max = sig[1] if sig.numel() > 1 else sig[0]
        out = []
        for i in [int(i) for i in steps]:
            x = trajectory.latents[i : i + 1].to(self.device)
            v = self.velocity(x, trajectory.timesteps[i], cond, uncond, guidance_scale, guidance_scale_2)
            step = sde_step(
                v, x, sig[i], sig[i + 1], s_max, sde_type=sde_type, noise_level=noise_level,
                prev_sample=trajectory.latents[i + 1 : i + 2].to(self.device),
            )
            out.append(step.log_prob[0])
        return torch.stack(out) if out else torch.zeros(0)

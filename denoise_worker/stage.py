"""Denoise stage: the Wan transformer(s), request-local schedulers, guidance."""

from __future__ import annotations

import time

import torch
from diffusers import WanTransformer3DModel

from common.messages import PROTOCOL_VERSION, DecodeRequest, DenoiseRequest, GenerationParams, Result
from common.model import MAX_SEQUENCE_LENGTH, ModelInfo
from common.worker import Forward, Stage
from denoise_worker import schedulers


def pad_embeddings(embeds: torch.Tensor, length: int = MAX_SEQUENCE_LENGTH) -> torch.Tensor:
    """[L, D] -> [1, length, D], zero-padded after the real tokens as Wan expects."""
    out = embeds.new_zeros((1, length, embeds.shape[-1]))
    out[0, : embeds.shape[0]] = embeds
    return out


def initial_noise(info: ModelInfo, params: GenerationParams) -> torch.Tensor:
    """The seed's initial latents, drawn exactly as diffusers' WanPipeline draws them."""
    generator = torch.Generator("cpu").manual_seed(params.seed)
    shape = info.latent_shape(params.height, params.width, params.num_frames)
    return torch.randn(shape, generator=generator, dtype=torch.float32)


class DenoiseStage(Stage):
    role = "denoise"

    def load(self) -> None:
        self.info = ModelInfo.read(self.config.model)
        self.transformer = self._load_transformer("transformer")
        self.transformer_2 = self._load_transformer("transformer_2") if self.info.has_transformer_2 else None
        self.serving_template = schedulers.load_serving_template(self.info.path)

    def _load_transformer(self, name: str) -> WanTransformer3DModel:
        model = WanTransformer3DModel.from_pretrained(self.info.path / name, dtype=self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _expert_for(self, t: torch.Tensor, params: GenerationParams, n_train: int):
        """Wan2.2 two-expert split: high-noise steps on ``transformer``, the rest on ``transformer_2``."""
        ratio = self.info.boundary_ratio
        if ratio is None or self.transformer_2 is None or t >= ratio * n_train:
            return self.transformer, params.guidance_scale
        g2 = params.guidance_scale_2 if params.guidance_scale_2 is not None else params.guidance_scale
        return self.transformer_2, g2

    @torch.no_grad()
    def velocity(self, latents, t, cond, uncond, params, n_train) -> torch.Tensor:
        """Model output at ``t`` after classifier-free guidance."""
        model, scale = self._expert_for(t, params, n_train)
        x = latents.to(model.dtype)
        timestep = t.expand(latents.shape[0])
        v = model(hidden_states=x, timestep=timestep, encoder_hidden_states=cond, return_dict=False)[0]
        if uncond is not None:
            v_u = model(hidden_states=x, timestep=timestep, encoder_hidden_states=uncond, return_dict=False)[0]
            v = v_u + scale * (v - v_u)
        return v

    @torch.no_grad()
    def denoise(self, params: GenerationParams, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        dtype = self.transformer.dtype
        cond = pad_embeddings(tensors["prompt_embeds"]).to(self.device, dtype)
        uncond = None
        if params.guidance_scale > 1.0:
            uncond = pad_embeddings(tensors["negative_prompt_embeds"]).to(self.device, dtype)
        scheduler = schedulers.build(self.serving_template, params, self.device)
        n_train = scheduler.config.num_train_timesteps
        latents = initial_noise(self.info, params).to(self.device)
        for t in scheduler.timesteps:
            v = self.velocity(latents, t, cond, uncond, params, n_train)
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
        return latents

    def process(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> Forward:
        t0 = time.perf_counter()
        latents = self.denoise(msg.params, tensors)
        timings = {**msg.timings, "denoise_s": time.perf_counter() - t0}
        if msg.params.output_type == "latent":
            out = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role, timings=timings)
            return Forward("router", out, {"output": latents[0].float()})
        nxt = DecodeRequest(
            v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=msg.params, timings=timings
        )
        return Forward("decode", nxt, {"latents": latents})

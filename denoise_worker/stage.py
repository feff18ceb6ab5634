"""Denoise stage: the Wan transformer(s), request-local schedulers, guidance, weight sync."""

from __future__ import annotations

import time

import torch
from diffusers import WanTransformer3DModel

from common.guidance import expert_for_timestep, guided_velocity, pad_embeddings
from common.messages import PROTOCOL_VERSION, ControlRequest, DecodeRequest, DenoiseRequest, Result
from common.model import ModelInfo
from common.weights import WeightsError, load_into, read_weights, state_dict_checksum
from common.worker import Forward, RequestError, Stage, check_deadline
from denoise_worker import schedulers
from denoise_worker.task import DenoiseTask


class UpdatesDisabled(RequestError):
    status = 403


class DenoiseStage(Stage):
    role = "denoise"

    def load(self) -> None:
        self.info = ModelInfo.read(self.config.model)
        self.experts = {"transformer": self._load_transformer("transformer")}
        if self.info.has_transformer_2:
            self.experts["transformer_2"] = self._load_transformer("transformer_2")
        self.serving_template = schedulers.load_serving_template(self.info.path)
        self.rollout_template = schedulers.rollout_template_for(self.serving_template)
        self.n_train = self.serving_template.config.num_train_timesteps
        self.weight_version = 0

    def _load_transformer(self, name: str) -> WanTransformer3DModel:
        model = WanTransformer3DModel.from_pretrained(self.info.path / name, dtype=self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def expert_for(self, t: torch.Tensor, task: DenoiseTask) -> tuple[torch.nn.Module, float]:
        """Wan2.2 two-expert split: high-noise steps on ``transformer``, the rest on ``transformer_2``."""
        p = task.params
        name = expert_for_timestep(t, self.info.boundary_ratio, self.n_train, "transformer_2" in self.experts)
        if name == "transformer":
            return self.experts[name], p.guidance_scale
        return self.experts[name], p.guidance_scale_2 if p.guidance_scale_2 is not None else p.guidance_scale

    def new_task(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> DenoiseTask:
        p = msg.params
        dtype = self.experts["transformer"].dtype
        if "prompt_embeds" not in tensors:
            raise RequestError("denoise request without prompt_embeds")
        cond = pad_embeddings(tensors["prompt_embeds"]).to(self.device, dtype)
        uncond = None
        if p.guidance_scale > 1.0:
            if "negative_prompt_embeds" not in tensors:
                raise RequestError("guidance_scale > 1 but no negative_prompt_embeds")
            uncond = pad_embeddings(tensors["negative_prompt_embeds"]).to(self.device, dtype)
        return DenoiseTask.create(
            p, cond, uncond, self.info, self.serving_template, self.rollout_template, self.device
        )

    @torch.no_grad()
    def run(self, task: DenoiseTask) -> None:
        while not task.done:
            check_deadline(task.params)  # stop spending steps on a request already answered
            t = task.timestep
            model, scale = self.expert_for(t, task)
            task.advance(guided_velocity(model, task.latents, t, task.cond, task.uncond, scale))

    def process(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> Forward:
        t0 = time.perf_counter()
        task = self.new_task(msg, tensors)
        self.run(task)
        timings = {**msg.timings, "denoise_s": time.perf_counter() - t0}
        info = {"scheduler": type(task.scheduler).__name__, "weight_version": self.weight_version}
        extras = task.extras()
        if msg.params.output_type == "latent":
            out = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role, timings=timings, info=info)
            return Forward("router", out, {"output": task.latents[0].float(), **extras})
        nxt = DecodeRequest(
            v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=msg.params,
            timings=timings, info=info,
        )
        return Forward("decode", nxt, {"latents": task.latents, **extras})

    # --- weight sync -------------------------------------------------------
    def control(self, msg: ControlRequest) -> dict:
        module = self.experts.get(msg.module)
        if module is None:
            raise RequestError(f"module: this model has no {msg.module}")
        if msg.op == "update_weights":
            if not msg.path:
                raise RequestError("path: required")
            if not self.config.weight_roots:  # the router refuses first; never read from anywhere
                raise UpdatesDisabled("weight updates are disabled: start the engine with --weight-root DIR")
            roots = self.config.weight_roots
            try:
                t0 = time.perf_counter()
                load_into(module, read_weights(msg.path, allowed_roots=roots))
            except WeightsError as e:
                raise RequestError(str(e)) from None
            self.weight_version = msg.version if msg.version is not None else self.weight_version + 1
            return {"weight_version": self.weight_version, "load_s": time.perf_counter() - t0,
                    "sha256": state_dict_checksum(module)}
        return {"weight_version": self.weight_version, "sha256": state_dict_checksum(module)}

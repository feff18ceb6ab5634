"""Denoise stage: the Wan transformer(s), request-local schedulers, guidance, weight sync."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from diffusers import WanTransformer3DModel

from common.wan.policy import expert_for_timestep, guidance_for, guided_velocity, pad_embeddings
from common.protocol.messages import PROTOCOL_VERSION, ControlRequest, DecodeRequest, DenoiseRequest, Result
from common.wan.model_info import ModelInfo
from common.wan.weights import WeightsError, load_into, read_weights, state_dict_checksum
from common.protocol.errors import DeadlineExceeded, RequestError, check_deadline
from common.runtime.stage import Forward, Stage
from common.wan import schedulers
from denoise_worker.task import DenoiseTask


# Multiply-accumulates (roughly samples x tokens x width^2) below which a forward runs on one thread.
SMALL_FORWARD = 5e7


class UpdatesDisabled(RequestError):
    status = 403


@dataclass
class _Active:
    """A request being denoised: its message, its task, when it arrived."""

    msg: DenoiseRequest
    task: DenoiseTask
    t0: float
    seq: int
    largest_batch: int = 0  # reported with the result: the most requests it shared a forward with


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
        self.max_threads = torch.get_num_threads()
        self.max_batch = max(1, self.config.max_batch_size)
        self.active: list[_Active] = []
        self._seq = itertools.count()

    def _load_transformer(self, name: str) -> WanTransformer3DModel:
        model = WanTransformer3DModel.from_pretrained(self.info.path / name, dtype=self.dtype)
        return model.to(self.device).eval().requires_grad_(False)

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

    # --- continuous batching ----------------------------------------------
    def accept(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> None:
        self.active.append(_Active(msg, self.new_task(msg, tensors), time.perf_counter(), next(self._seq)))

    def can_accept(self) -> bool:
        return len(self.active) < 4 * self.max_batch

    def has_work(self) -> bool:
        return bool(self.active)

    def held(self) -> int:
        return len(self.active)

    def _expert_name(self, task: DenoiseTask) -> str:
        return expert_for_timestep(task.timestep, self.info.boundary_ratio, self.n_train, "transformer_2" in self.experts)

    def _next_batch(self) -> list["_Active"]:
        """The oldest request plus up to ``max_batch - 1`` others that can share its forward.

        Sharing needs the same latent shape and the same expert; each sample
        keeps its own timestep, text embeddings and guidance scale.
        """
        oldest = min(self.active, key=lambda a: a.seq)
        key = (tuple(oldest.task.latents.shape), self._expert_name(oldest.task))
        same = [a for a in self.active if (tuple(a.task.latents.shape), self._expert_name(a.task)) == key]
        return sorted(same, key=lambda a: a.seq)[: self.max_batch]

    @torch.no_grad()
    def batched_velocity(self, tasks: list[DenoiseTask]) -> list[torch.Tensor]:
        """Guided model outputs for tasks at (possibly) different steps, in one forward.

        Conditional halves come first, then the unconditional halves of the
        tasks that use guidance; ``uncond + g * (cond - uncond)`` per task, in
        the model's dtype, as in :func:`common.wan.policy.guided_velocity`.
        """
        name = self._expert_name(tasks[0])
        model = self.experts[name]
        self._size_threads(model, tasks)
        if len(tasks) == 1:
            # Alone: two passes exactly as diffusers' pipeline (and a trainer's recompute) take them.
            t = tasks[0]
            scale = guidance_for(name, t.params.guidance_scale, t.params.guidance_scale_2)
            return [guided_velocity(model, t.latents, t.timestep, t.cond, t.uncond, scale)]
        guided = [i for i, t in enumerate(tasks) if t.uncond is not None]
        x = torch.cat([t.latents for t in tasks]).to(model.dtype)
        ts = torch.stack([t.timestep.float() for t in tasks])
        hidden = torch.cat([x, x[guided]]) if guided else x
        steps = torch.cat([ts, ts[guided]]) if guided else ts
        text = torch.cat([t.cond for t in tasks] + [tasks[i].uncond for i in guided])
        out = model(hidden_states=hidden, timestep=steps, encoder_hidden_states=text, return_dict=False)[0]
        result = [out[i : i + 1] for i in range(len(tasks))]
        for j, i in enumerate(guided):
            p = tasks[i].params
            scale = guidance_for(name, p.guidance_scale, p.guidance_scale_2)
            v_u = out[len(tasks) + j : len(tasks) + j + 1]
            result[i] = v_u + scale * (result[i] - v_u)
        return result

    def _size_threads(self, model: torch.nn.Module, tasks: list[DenoiseTask]) -> None:
        """Intra-op threads only for forwards big enough to gain from them (CPU).

        On a small forward, waking threads costs more than it saves: measured on
        the tiny model, one thread halves the denoise CPU time per request, while
        a compute-bound model needs every core for its latency.
        """
        if self.device.type != "cpu" or self.max_threads == 1:
            return
        cfg = model.config
        width = cfg.num_attention_heads * cfg.attention_head_dim
        p = cfg.patch_size
        shape = tasks[0].latents.shape
        tokens = (shape[2] // p[0]) * (shape[3] // p[1]) * (shape[4] // p[2]) + tasks[0].cond.shape[1]
        samples = sum(2 if t.uncond is not None else 1 for t in tasks)
        threads = self.max_threads if samples * tokens * width * width >= SMALL_FORWARD else 1
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def work(self) -> list[tuple[DenoiseRequest, Forward | BaseException]]:
        """One batched step for the oldest compatible group; returns the requests that left."""
        done: list[tuple[DenoiseRequest, Forward | BaseException]] = []
        for a in list(self.active):
            try:
                check_deadline(a.task.params)  # stop spending steps on a request already answered
            except DeadlineExceeded as e:
                self.active.remove(a)
                done.append((a.msg, e))
        if not self.active:
            return done
        batch = self._next_batch()
        try:
            velocities = self.batched_velocity([a.task for a in batch])
        except Exception as e:  # a failed forward fails the requests that were in it, nothing else
            for a in batch:
                self.active.remove(a)
                done.append((a.msg, e))
            return done
        for a, v in zip(batch, velocities):
            a.largest_batch = max(a.largest_batch, len(batch))
            try:
                a.task.advance(v)
                if a.task.done:
                    self.active.remove(a)
                    done.append((a.msg, self._finished(a)))
            except Exception as e:
                self.active.remove(a)
                done.append((a.msg, e))
        return done

    def _finished(self, a: "_Active") -> Forward:
        msg, task = a.msg, a.task
        timings = {**msg.timings, "denoise_s": time.perf_counter() - a.t0}
        info = {"scheduler": type(task.scheduler).__name__, "weight_version": self.weight_version,
                "batch": a.largest_batch}
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

"""Denoise stage: continuous batching of request-local denoising over the model's policy, and weight sync."""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from common.protocol.control import ReleaseMemory, ReleaseReply, ResumeMemory, ResumeReply
from common.protocol.errors import Cancelled, RequestError
from common.protocol.messages import (
    LATENTS,
    OUTPUT,
    PROTOCOL_VERSION,
    DecodeRequest,
    DenoiseRequest,
    Result,
    StepProgress,
)
from common.runtime.component_memory import ComponentMemory
from common.runtime.stage import Forward, Stage
from common.transport.cuda_ipc import receiver_for
from common.diffusion.compiled import compile_experts, warm_up
from common.families import read_model
from common.diffusion.policy import Policy
from denoise_worker.adapters import AdapterTable
from denoise_worker.controls import DenoiseControls, applies_between_steps
from denoise_worker.denoiser import Denoiser, Request
from denoise_worker.parallel_forward import ParallelForward, ParallelLayout
from denoise_worker.pinned import NO_PIN, Pinned
from denoise_worker.ranks import FollowerProcesses, join_group
from denoise_worker.task import DenoiseTask
from denoise_worker.weight_sync import WeightSync


log = logging.getLogger("disagg.denoise")

PROGRESS_INTERVAL_S = 0.5  # how often a request's step count goes to the router (none for shorter requests)


class DenoiseStage(Stage):
    role = "denoise"

    def load(self) -> None:
        self.info = read_model(self.config.model, self.config.transformer_file)
        self.family = self.info.family
        self.followers = None
        if self.spec.ranks > 1:  # a multi-device worker: the followers load while the leader does
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL's communicator works on the current device
            self.followers = FollowerProcesses(self.config, self.spec)
            self.followers.start()
        self.policy = Policy.load(self.info, self.dtype, self.device)
        if self.followers is not None:
            join_group(self.config, self.spec, 0)
            layout = ParallelLayout.of(self.spec, self.device.type)
            layout.prepare(self.policy)
            self.policy.ranks = ParallelForward(self.policy, layout)
        if self.config.compile:
            self._compile()
        self.adapters = AdapterTable(self.config, self.policy)
        self.controls = DenoiseControls(self)
        self.sync = WeightSync(self.config, self.device, receiver_for(self.config, self.spec))
        self.pinned: Pinned | None = None  # kl_reference "pinned" (POST /pin_reference)
        self.denoiser = Denoiser(self.policy, self.device, self.config.max_batch_size,
                                 size_threads_on_cpu=not self.config.compile, ranks=self.spec.ulysses * self.spec.ring,
                                 on_ranks=None if self.followers is None else self._ranks_failed)
        self.messages: dict[str, DenoiseRequest] = {}  # the held requests' messages, by id
        self.reported_at: dict[str, float] = {}  # when the router last heard of a request's step count
        self._notices: list[Forward] = []
        self.memory = ComponentMemory("transformer", self.policy.experts, self.fresh_modules)

    def _compile(self) -> None:
        """Every expert through torch.compile, compiled now at the default request's shape (the followers'
        too: the warm-up's forwards reach them)."""
        compile_experts(self.policy)
        seconds = warm_up(self.policy)
        log.info("compiled %s", ", ".join(f"{name} in {s:.1f}s" for name, s in seconds.items()))

    def idle(self) -> None:
        self.sync.idle()

    def close(self) -> None:
        if self.followers is not None:
            self.followers.stop(self.policy.ranks.stop)

    def notices(self) -> list[Forward]:
        out, self._notices = self._notices, []
        return out

    @property
    def weight_version(self) -> int:
        return self.denoiser.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.denoiser.weight_version = version

    def _ranks_failed(self, error: Exception) -> None:  # collectives left undone: the worker goes, its requests run again
        self.followers.abandon(f"a forward failed: {type(error).__name__}: {error}")

    # --- continuous batching: the Denoiser's (denoise_worker/denoiser.py) ---------------------------
    def new_task(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> DenoiseTask:
        p, reference = msg.params, None
        if p.rollout is not None and p.rollout.return_kl and p.rollout.kl_reference == "pinned":
            if self.pinned is None:
                raise RequestError(NO_PIN)
            reference = self.pinned.policy
        return self.denoiser.task(p, tensors, lora=self.adapters.choice(p), reference=reference)

    def accept(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> None:
        self.denoiser.add(msg.request_id, self.new_task(msg, tensors))
        self.messages[msg.request_id] = msg
        self.reported_at[msg.request_id] = time.perf_counter()

    def can_accept(self) -> bool:
        return self.denoiser.samples < 4 * self.denoiser.max_batch  # (a shared prefix grows to n)

    def has_work(self) -> bool:
        return bool(self.denoiser.requests)

    def work(self) -> list[tuple[DenoiseRequest, Forward | BaseException]]:
        """One batched step of the Denoiser; the requests that left, with what goes on (or their error)."""
        left = self.denoiser.step()
        self._report_progress()
        return [self._answer(out.request, out.error) for out in left]

    def _report_progress(self) -> None:
        now = time.perf_counter()
        for r in self.denoiser.last_stepped:
            if now - self.reported_at.get(r.id, now) >= PROGRESS_INTERVAL_S:
                self.reported_at[r.id] = now
                self._notices.append(Forward("router", StepProgress(
                    v=PROTOCOL_VERSION, request_id=r.id, step=r.task.step, steps=len(r.task.scheduler.timesteps))))
        self.denoiser.last_stepped = []

    def _answer(self, r: Request, error: BaseException | None, partial: bool = False):
        msg = self.messages.pop(r.id)
        self.reported_at.pop(r.id, None)
        if error is not None:
            return msg, error
        try:
            return msg, self._finished(msg, r, partial)
        except Exception as e:
            return msg, e

    def cancel(self, request_id: str, partial: bool) -> tuple[DenoiseRequest, Forward | BaseException] | None:
        """A cancelled request leaves now, between two steps; a rollout asked for ``partial`` answers the router
        with the steps it has taken (its latents so far, log-probs, trajectory; ``steps_done`` in its info)."""
        r = self.denoiser.abort(request_id)
        if r is None:
            return None
        if partial and r.task.params.rollout is not None:
            return self._answer(r, None, partial=True)
        return self._answer(r, Cancelled(f"request cancelled at denoising step {r.task.step}"))

    def _finished(self, msg: DenoiseRequest, r: Request, partial: bool = False) -> Forward:
        task = r.task
        timings = {**msg.timings, "denoise_s": time.perf_counter() - r.t0}
        info = self.denoiser.info_of(r, partial)
        extras = task.extras()
        if msg.params.output_type == "latent" or partial:  # a partial answer: latents, never decoded
            out = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role, timings=timings, info=info)
            return Forward("router", out, {OUTPUT.name: task.output_latents().float(), **extras})
        nxt = DecodeRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=msg.params,
                            timings=timings, info=info)
        return Forward("decode", nxt, {LATENTS.name: task.output_latents(), **extras})

    # --- releasing and resuming the weights ---------------------------------------------
    def fresh_modules(self) -> dict[str, torch.nn.Module]:
        return Policy.load(self.info, self.dtype, self.device).experts

    def drop_work(self) -> int:
        dropped = len(self.denoiser.requests)
        self.denoiser.requests.clear()
        self.messages.clear()
        self.reported_at.clear()
        return dropped

    def release_memory(self, msg: ReleaseMemory) -> ReleaseReply:
        """Every rank's experts; and the trainer's last buckets, which a worker keeps mapped between pushes."""
        if self.policy.ranks is not None:
            self.policy.ranks.memory("release", level=msg.level)
        self.sync.release()
        return super().release_memory(msg)

    def resume_memory(self, msg: ResumeMemory) -> ResumeReply:
        reloaded = self.memory.missing()
        reply = super().resume_memory(msg)
        if self.policy.ranks is not None:  # host copies back on each rank; what the leader reloaded, broadcast
            self.policy.ranks.memory("resume")
            for name in reloaded:
                self.policy.ranks.share_weights(name)
        if reloaded:  # the model directory's weights again: a new weight version
            self.weight_version = msg.version if msg.version is not None else self.weight_version + 1
        return msgspec.structs.replace(reply, weight_version=self.weight_version, reloaded=reloaded)

    # --- control messages: weight sync and adapters (denoise_worker/controls.py) ------------------
    def control_handlers(self) -> dict:
        return {**super().control_handlers(), **self.controls.table()}

    def applies_between_steps(self, msg) -> bool:
        return applies_between_steps(msg)

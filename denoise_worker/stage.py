"""Denoise stage: continuous batching of request-local denoising over the model's policy, and weight sync."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch

from common.protocol.control import ReleaseMemory, ReleaseReply, ResumeMemory, ResumeReply
from common.protocol.errors import Cancelled, DeadlineExceeded, RequestError, check_deadline
from common.protocol.messages import (
    INITIAL_LATENTS,
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
from common.diffusion import schedulers
from common.diffusion.compiled import compile_experts, warm_up
from common.families import read_model
from common.diffusion.cache_signals import teacache_settings
from common.diffusion.policy import Policy
from denoise_worker.adapters import AdapterTable
from denoise_worker.caching import request_cache
from denoise_worker.controls import DenoiseControls, applies_between_steps
from denoise_worker.forward import Outcome, step_each, step_velocities
from denoise_worker.joint_step import advance_all
from denoise_worker.parallel_forward import ParallelForward, ParallelLayout
from denoise_worker.pinned import NO_PIN, Pinned
from denoise_worker.ranks import FollowerProcesses, join_group
from denoise_worker.sequence_split import check_split
from denoise_worker.task import DenoiseTask, step_versions
from denoise_worker.texts import TextTable
from denoise_worker.threads import size_threads
from denoise_worker.weight_sync import WeightSync


log = logging.getLogger("disagg.denoise")

PROGRESS_INTERVAL_S = 0.5  # how often a request's step count goes to the router (none for shorter requests)


@dataclass
class _Active:
    """A request being denoised: its message, its task, when it arrived."""

    msg: DenoiseRequest
    task: DenoiseTask
    t0: float
    seq: int
    largest_batch: int = 0  # reported with the result: the most samples it shared a step with
    reported_at: float = 0.0  # when the router last heard of its step count
    step_versions: list[int] = field(default_factory=list)  # the weight version each step it took ran on


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
        self.texts = TextTable(self.family, self.device, self.policy.dtype)
        self.sync = WeightSync(self.config, self.device, receiver_for(self.config, self.spec))
        self.teacache = teacache_settings(self.info)
        self.serving_template = schedulers.load_serving_template(self.info)
        self.rollout_template = schedulers.rollout_template_for(self.serving_template)
        self.weight_version = 0
        self.pinned: Pinned | None = None  # kl_reference "pinned" (POST /pin_reference)
        self.max_threads = torch.get_num_threads()
        self.max_batch = max(1, self.config.max_batch_size)
        self.active: list[_Active] = []
        self._seq = itertools.count()
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

    def new_task(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> DenoiseTask:
        p = msg.params
        cond = self.texts.conditioning(self._text(tensors, {f.name: f.name for f in self.family.text.fields}),
                                       p.max_sequence_length)
        uncond = None
        if self.family.guidance.uses_cfg(p):
            negative = self._text(tensors, self.family.text.negatives())
            uncond = self.texts.conditioning(negative, p.max_sequence_length)
        image = self.family.condition.from_wire({f.name: tensors[f.name] for f in self.family.condition.fields
                                                if f.name in tensors})
        if image is None and self.family.condition.image_input(self.info) == "required":
            raise RequestError(f"{self.family.pipeline} needs the image tensors "
                               f"{', '.join(f.name for f in self.family.condition.fields)}")
        task = DenoiseTask.create(p, cond, uncond, self.info, self.serving_template, self.rollout_template,
                                  self.device, lora=self.adapters.choice(p),
                                  image=None if image is None else image.to(self.device),
                                  initial_latents=tensors.get(INITIAL_LATENTS.name))
        check_split(task, self.spec.ulysses * self.spec.ring)  # a sequence the ranks cannot share: refused alone
        task.cache = request_cache(task, self.teacache)
        if p.rollout is not None and p.rollout.return_kl and p.rollout.kl_reference == "pinned":
            if self.pinned is None:
                raise RequestError(NO_PIN)
            task.reference = self.pinned.policy
        return task

    def _text(self, tensors: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
        """A prompt's text tensors (by their cond names) from the message's ``names`` (the family's contract),
        with the image tensors the transformer's cross-attention takes beside the text (image embeds)."""
        missing = [wire for wire in names.values() if wire not in tensors]
        if missing:
            raise RequestError(f"{self.family.pipeline} needs the text tensors {', '.join(missing)}")
        text = {name: tensors[wire] for name, wire in names.items()}
        text.update({f.name: tensors[f.name] for f in self.family.condition.fields
                     if f.name in tensors and f.name in self.family.condition.text_fields})
        return text

    # --- continuous batching ----------------------------------------------
    def accept(self, msg: DenoiseRequest, tensors: dict[str, torch.Tensor]) -> None:
        now = time.perf_counter()
        self.active.append(_Active(msg, self.new_task(msg, tensors), now, next(self._seq), reported_at=now))

    def can_accept(self) -> bool:
        return sum(a.task.samples for a in self.active) < 4 * self.max_batch  # (a shared prefix grows to n)

    def has_work(self) -> bool:
        return bool(self.active)

    def _next_batch(self) -> list[_Active]:
        """The oldest request plus others that can share its forward, up to ``max_batch`` samples in all.

        Sharing needs the same latent shape, size (packed latents of two sizes may share a shape), expert,
        texts the transformer takes together (``Binding.text.key``: texts of one length, unless it masks
        padding) and image layout (``Binding.condition.batch_key``: edits with references of other sizes
        run apart); each request keeps its own timestep, text embeddings and guidance scale. A request
        larger than ``max_batch`` runs alone, its forward in parts.
        """
        def key(a: _Active):
            p, task = a.task.params, a.task
            texts = [t for t in (task.cond, task.uncond) if t is not None]
            return (tuple(task.latents.shape[1:]), (p.height, p.width), self.policy.expert_for(task.timestep),
                    self.family.text.key(texts), self.family.condition.batch_key(task.image),
                    self.family.latents.layout(self.info, p))

        oldest = min(self.active, key=lambda a: a.seq)
        batch, samples = [], 0
        for a in sorted((a for a in self.active if key(a) == key(oldest)), key=lambda a: a.seq):
            if not batch or samples + a.task.n <= self.max_batch:
                batch.append(a)
                samples += a.task.n
        return batch

    def batched_velocity(self, tasks: list[DenoiseTask]) -> tuple[list[Outcome], bool]:
        """Guided model outputs ([n, ...] per task) for tasks at (possibly) different steps, or a task's own
        error, and whether they shared forwards (denoise_worker/forward.py). On several ranks a failure raises:
        it left their collectives half done."""
        before = None
        if self.device.type == "cpu" and not self.config.compile:  # compiled graphs guard on the thread count
            p = tasks[0].params  # the tasks of one forward have one size
            size = self.family.latents.size(self.info, p.height, p.width, p.fields)
            tokens = self.family.latents.image_seq_len(self.info, *size, p.num_frames)

            def before(inputs):
                expert = self.policy.experts[self.policy.expert_for(inputs[0].timestep)]
                size_threads(expert, inputs, self.max_threads,
                             tokens + self.family.condition.extra_tokens(inputs[0].image))
        if self.followers is not None:
            return step_velocities(self.policy, tasks, self.max_batch, before), True
        return step_each(self.policy, tasks, self.max_batch, before)

    def _drop_expired(self) -> list[tuple[DenoiseRequest, BaseException]]:
        """Stop spending steps on requests the router has already answered with 504."""
        done = []
        for a in list(self.active):
            try:
                check_deadline(a.task.params)
            except DeadlineExceeded as e:
                done.append(self._leave(a, e))
        return done

    def work(self) -> list[tuple[DenoiseRequest, Forward | BaseException]]:
        """One batched step for the oldest compatible requests; returns the requests that left."""
        done: list[tuple[DenoiseRequest, Forward | BaseException]] = self._drop_expired()
        if not self.active:
            return done
        batch = self._next_batch()
        try:  # one process: a failed shared forward runs each request alone; those that fail alone fail
            outcomes, shared = self.batched_velocity([a.task for a in batch])
        except Exception as e:  # several ranks: collectives left undone; the worker goes, its requests run again
            if self.followers is not None:
                self.followers.abandon(f"a forward failed: {type(e).__name__}: {e}")
            return done + [self._leave(a, e) for a in batch]
        samples = sum(a.task.n for a in batch)  # (each alone when not shared)
        done += [self._leave(a, v) for a, v in zip(batch, outcomes) if isinstance(v, Exception)]
        stepped = [(a, v) for a, v in zip(batch, outcomes) if not isinstance(v, Exception)]
        batch, velocities = [a for a, _ in stepped], [v for _, v in stepped]
        now = time.perf_counter()
        for a, error in zip(batch, advance_all([a.task for a in batch], velocities)):
            a.largest_batch = max(a.largest_batch, samples if shared else a.task.n)
            if error is None:
                a.step_versions.append(self.weight_version)
            if error is None and not a.task.done and now - a.reported_at >= PROGRESS_INTERVAL_S:
                a.reported_at = now
                self._notices.append(Forward("router", StepProgress(
                    v=PROTOCOL_VERSION, request_id=a.msg.request_id, step=a.task.step,
                    steps=len(a.task.scheduler.timesteps))))
            if error is not None:
                done.append(self._leave(a, error))
            elif a.task.done:
                try:
                    done.append(self._leave(a, self._finished(a)))
                except Exception as e:
                    done.append(self._leave(a, e))
        return done

    def _leave(self, a: _Active, outcome: Forward | BaseException) -> tuple[DenoiseRequest, Forward | BaseException]:
        self.active.remove(a)
        return a.msg, outcome

    def cancel(self, request_id: str, partial: bool) -> tuple[DenoiseRequest, Forward | BaseException] | None:
        """A cancelled request leaves now, between two steps; a rollout asked for ``partial`` answers the router
        with the steps it has taken (its latents so far, log-probs, trajectory; ``steps_done`` in its info)."""
        a = next((a for a in self.active if a.msg.request_id == request_id), None)
        if a is None:
            return None
        if partial and a.msg.params.rollout is not None:
            return self._leave(a, self._finished(a, partial=True))
        return self._leave(a, Cancelled(f"request cancelled at denoising step {a.task.step}"))

    def _finished(self, a: _Active, partial: bool = False) -> Forward:
        msg, task = a.msg, a.task
        timings = {**msg.timings, "denoise_s": time.perf_counter() - a.t0}
        info = {"scheduler": type(task.scheduler).__name__, "schedule": task.schedule,
                "weight_version": self.weight_version, "batch": a.largest_batch, **task.pass_counts(),
                **task.window_info(),
                **({"steps_done": task.step} if partial else {})}
        if task.lora is not None:
            info.update(lora_name=task.lora[0].name, lora_version=task.lora[0].version)
        if msg.params.rollout is not None:  # each step taken, tagged with its versions (one per step, shared)
            info.update(step_versions(a.step_versions, task.lora))
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
        dropped = len(self.active)
        self.active.clear()
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

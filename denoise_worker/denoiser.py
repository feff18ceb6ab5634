"""The denoise step's owner, free of sockets and processes: requests in, batched steps, finished requests out.

:class:`Denoiser` holds the requests being denoised and takes one batched step at a time (:meth:`Denoiser.step`):
choose the oldest request and those that can share its forwards, plan each one's rows as data (caching, KL
reference rows, pinned rows, shared-prefix rows, guidance passes: denoise_worker/forward.py ``plan_rows``), run
the forwards and guide (``step_each``), advance each request with its step variant (denoise_worker/joint_step.py)
and record what it returns. The denoise worker is its transport (denoise_worker/stage.py); the in-process
engine, the tests and the benches build the same object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.diffusion import schedulers
from common.diffusion.cache_signals import teacache_settings
from common.diffusion.policy import ModelInput, Policy
from common.protocol.errors import DeadlineExceeded, RequestError, check_deadline
from common.protocol.messages import INITIAL_LATENTS, GenerationParams
from denoise_worker.caching import request_cache
from denoise_worker.forward import Outcome, step_each, step_velocities
from denoise_worker.joint_step import advance_all
from denoise_worker.sequence_split import check_split
from denoise_worker.task import DenoiseTask, step_versions
from denoise_worker.texts import TextTable
from denoise_worker.threads import size_threads


@dataclass
class Request:
    """A request being denoised: its id, its task, and what its answer reports besides the task's tensors."""

    id: str
    task: DenoiseTask
    t0: float = field(default_factory=time.perf_counter)
    largest_batch: int = 0  # the most samples it shared a step with
    step_versions: list[int] = field(default_factory=list)  # the weight version each step it took ran on


@dataclass(frozen=True)
class Left:
    """A request that leaves the denoiser: finished (``error`` None: its task is done) or failed."""

    request: Request
    error: BaseException | None = None


class Denoiser:
    def __init__(self, policy: Policy, device: torch.device, max_batch: int, *, size_threads_on_cpu: bool = True,
                 ranks: int = 1, on_ranks: Callable[[Exception], None] | None = None):
        """``size_threads_on_cpu``: each CPU forward's threads sized to it (off for compiled graphs, which guard
        on the thread count); ``ranks``: the devices a sequence is split over (a sequence they cannot share is
        refused); ``on_ranks``: the forwards are collectives of several processes, so a failure is the whole
        batch's, never retried request by request; it is called with the error (the worker replaces itself)."""
        self.policy, self.info, self.family = policy, policy.info, policy.info.family
        self.device, self.max_batch, self.ranks, self.on_ranks = device, max(1, max_batch), ranks, on_ranks
        self.texts = TextTable(self.family, device, policy.dtype)
        self.teacache = teacache_settings(self.info)
        self.serving_template = schedulers.load_serving_template(self.info)
        self.rollout_template = schedulers.rollout_template_for(self.serving_template)
        self.max_threads = torch.get_num_threads()
        self.size_threads = size_threads_on_cpu and device.type == "cpu"
        self.weight_version = 0  # the weights' version, tagged on each step taken
        self.requests: list[Request] = []  # in arrival order: the oldest leads the next batch
        self.last_stepped: list[Request] = []  # the requests of the last step that are still held
        self.shared_forwards = 0  # forwards that held more than one request's rows
        self._image_tokens = 0  # the current batch's image sequence (thread sizing)
        self.observe: Callable[[list[ModelInput]], None] | None = None  # sees each forward's inputs (tests)

    # --- requests in and out ---------------------------------------------------------------------------
    def task(self, params: GenerationParams, tensors: dict[str, torch.Tensor], lora=None,
             reference: Policy | None = None) -> DenoiseTask:
        """A request's task from its wire tensors (the encoder's text and image tensors, a resumed rollout's
        ``initial_latents``); ``lora``: its adapter and scale; ``reference``: a pinned KL reference."""
        cond = self.texts.conditioning(self._text(tensors, {f.name: f.name for f in self.family.text.fields}),
                                       params.max_sequence_length)
        uncond = None
        if self.family.guidance.uses_cfg(params):
            negative = self._text(tensors, self.family.text.negatives())
            uncond = self.texts.conditioning(negative, params.max_sequence_length)
        image = self.family.condition.from_wire({f.name: tensors[f.name] for f in self.family.condition.fields
                                                if f.name in tensors})
        if image is None and self.family.condition.image_input(self.info) == "required":
            raise RequestError(f"{self.family.pipeline} needs the image tensors "
                               f"{', '.join(f.name for f in self.family.condition.fields)}")
        task = DenoiseTask.create(params, cond, uncond, self.info, self.serving_template, self.rollout_template,
                                  self.device, lora=lora, image=None if image is None else image.to(self.device),
                                  initial_latents=tensors.get(INITIAL_LATENTS.name))
        check_split(task, self.ranks)  # a sequence the ranks cannot share: refused alone
        task.cache = request_cache(task, self.teacache)
        task.reference = reference
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

    def add(self, request_id: str, task: DenoiseTask) -> Request:
        request = Request(request_id, task)
        self.requests.append(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        """Take a request out between two steps (None: not held)."""
        r = next((r for r in self.requests if r.id == request_id), None)
        if r is not None:
            self.requests.remove(r)
        return r

    @property
    def samples(self) -> int:
        return sum(r.task.samples for r in self.requests)

    # --- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[Left]:
        """One batched step for the oldest request and those that can share its forwards; the requests that
        left (finished, failed, or past their deadline)."""
        expired = self._leave(self._expired())
        return expired + self._leave(self.run(self._next_batch()))

    def run(self, batch: list[Request]) -> list[Left]:
        """One step for every request of ``batch`` (each at its own step): plan each one's rows, run the forwards
        and guide, advance each with its step variant, record; the requests that failed or finished."""
        if not batch:
            return []
        outcomes, shared = self._forwards([r.task for r in batch])
        failed = [Left(r, o) for r, o in zip(batch, outcomes) if isinstance(o, Exception)]
        stepped = [(r, o) for r, o in zip(batch, outcomes) if not isinstance(o, Exception)]
        errors = advance_all([r.task for r, _ in stepped], [o for _, o in stepped])
        samples = sum(r.task.n for r in batch) if shared else None
        recorded = [self._recorded(r, e, samples) for (r, _), e in zip(stepped, errors)]
        self.last_stepped = [r for (r, _), e in zip(stepped, errors) if e is None and not r.task.done]
        return failed + [out for out in recorded if out is not None]

    def _expired(self) -> list[Left]:
        """Stop spending steps on requests whose deadline passed (the router answered them with 504)."""
        out = []
        for r in self.requests:
            try:
                check_deadline(r.task.params)
            except DeadlineExceeded as e:
                out.append(Left(r, e))
        return out

    def _next_batch(self) -> list[Request]:
        """The oldest request plus others that can share its forward, up to ``max_batch`` samples in all.

        Sharing needs the same latent shape, size (packed latents of two sizes may share a shape), expert,
        texts the transformer takes together (``Binding.text.key``: texts of one length, unless it masks
        padding) and image layout (``Binding.condition.batch_key``: edits with references of other sizes
        run apart); each request keeps its own timestep, text embeddings and guidance scale. A request
        larger than ``max_batch`` runs alone, its forward in parts.
        """
        if not self.requests:
            return []

        def key(r: Request):
            task = r.task
            p, texts = task.params, [t for t in (task.cond, task.uncond) if t is not None]
            return (tuple(task.latents.shape[1:]), (p.height, p.width), self.policy.expert_for(task.timestep),
                    self.family.text.key(texts), self.family.condition.batch_key(task.image),
                    self.family.latents.layout(self.info, p))

        oldest = key(self.requests[0])
        batch, samples = [], 0
        for r in (r for r in self.requests if key(r) == oldest):
            if not batch or samples + r.task.n <= self.max_batch:
                batch.append(r)
                samples += r.task.n
        return batch

    def _forwards(self, tasks: list[DenoiseTask]) -> tuple[list[Outcome], bool]:
        """Each task's guided outputs (or its own error), and whether they came from shared forwards. On several
        ranks a failure is the batch's: every task gets it (their collectives were left half done)."""
        if self.size_threads:  # the tasks of one forward have one size: its image tokens size the threads
            p = tasks[0].params
            self._image_tokens = self.family.latents.image_seq_len(
                self.info, *self.family.latents.size(self.info, p.height, p.width, p.fields), p.num_frames)
        if self.on_ranks is not None:
            try:
                return step_velocities(self.policy, tasks, self.max_batch, self._before_forward), True
            except Exception as e:
                self.on_ranks(e)
                return [e] * len(tasks), True
        return step_each(self.policy, tasks, self.max_batch, self._before_forward)

    def _before_forward(self, inputs: list[ModelInput]) -> None:
        self.shared_forwards += len(inputs) > 1
        if self.observe is not None:
            self.observe(inputs)
        if not self.size_threads:
            return
        x = inputs[0]
        size_threads(self.policy.experts[self.policy.expert_for(x.timestep)], inputs, self.max_threads,
                     self._image_tokens + self.family.condition.extra_tokens(x.image))

    def _recorded(self, r: Request, error: BaseException | None, shared_samples: int | None) -> Left | None:
        """A request after its step: its bookkeeping, and whether it leaves (failed, or its last step)."""
        r.largest_batch = max(r.largest_batch, shared_samples or r.task.n)
        if error is not None:
            return Left(r, error)
        r.step_versions.append(self.weight_version)
        return Left(r) if r.task.done else None

    def _leave(self, left: list[Left]) -> list[Left]:
        for out in left:
            if out.request in self.requests:
                self.requests.remove(out.request)
        return left

    # --- the answer --------------------------------------------------------------------------------------
    def info_of(self, r: Request, partial: bool = False) -> dict:
        """What the answer's ``info`` reports of a request's denoising (a partial answer: the steps done)."""
        task = r.task
        info = {"scheduler": type(task.scheduler).__name__, "schedule": task.schedule,
                "weight_version": self.weight_version, "batch": r.largest_batch, **task.pass_counts(),
                **task.window_info(), **({"steps_done": task.step} if partial else {})}
        if task.lora is not None:
            info.update(lora_name=task.lora[0].name, lora_version=task.lora[0].version)
        if task.params.rollout is not None:  # each step taken, tagged with its versions (one per step, shared)
            info.update(step_versions(r.step_versions, task.lora))
        return info

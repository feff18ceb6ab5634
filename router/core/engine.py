"""The router's core: one object that owns the engine's state and offers every operation as a plain method.

:class:`Engine` builds and wires the domain pieces (the dispatcher's workers, weights, adapters, weight sync from
memory, sleep, the in-flight table, cancellations, metrics, the video jobs) and turns a request body into
:class:`GenerationParams` once, with every check. The fronts call it: the native HTTP API (router/api/), the
OpenAI API (router/openai/), and through them the page and the Python client. They only parse, call and answer.
Nothing here speaks HTTP (no FastAPI, no Starlette; tests/test_layout.py checks it): a failure raises the router's
one exception (router/core/errors.py), which the API turns into the JSON error shape.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.config.engine import EngineConfig
from common.diffusion.cache_signals import cache_problem
from common.diffusion.model_info import ModelInfo
from common.families import read_model
from common.builtin import BUILTINS
from common.protocol.messages import EXPERT_NAMES, LAST_IMAGE, GenerationParams
from router.request.images import decode_image
from router.request.schemas import (
    GenerateBody, InitWeightsGroupBody, LoadLoraBody, LoadLoraTensorsBody, UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorsBody, checked_module, checked_weight_path,
)
from router.control.weights import WeightControl
from router.control.lora import LoraControl
from router.control.pin import PinControl
from router.control.sleep import SleepControl, components_of
from router.control.weight_sync import MemorySync
from router.core.errors import EngineError, FieldError
from router.core.metrics import EngineState, Metrics
from router.core.pause import PauseGate
from router.core.progress import InFlight
from router.core.request_params import image_items, initial_latents, max_images, sized_by_image, to_params
from router.link.cancel import JOB_DELETED, Cancellations
from router.link.dispatcher import Dispatcher
from router.link.join import Outcome
from router.core.job_store import JobStore
from router.core.jobs import JobTable, Prepare, wait_for_room

WEIGHTS_DISABLED = "weight updates are disabled: start the engine with --weight-root DIR"
Gone = Callable[[], Awaitable[None]]  # returns once the caller went away (its request is then cancelled)
OnSample = Callable[[int, Outcome], None]  # a streaming request's sample i, as soon as it is decoded


def served_model_id(path: Path) -> str:
    """The model's name: a built-in's (``tiny``), else its directory's."""
    spec = path.name.rsplit("-", 1)[0]
    return spec if spec in BUILTINS and path.name != spec else path.name


@dataclass
class Generated:
    """A generation's answer: its parameters (defaults filled in), its outcome, and when it was admitted
    (``time.perf_counter()``: its elapsed time runs from there)."""

    params: GenerationParams
    outcome: Outcome
    started: float


class Engine:
    """The engine as the router sees it, over ``dispatcher`` (``info``: the model's facts, default read from
    ``config.model``; ``store``: the jobs' data dir, open and locked, default ``config.limits.data_dir``'s)."""

    def __init__(self, config: EngineConfig, dispatcher: Dispatcher, info: ModelInfo | None = None,
                 store: JobStore | None = None):
        self.config, self.dispatcher = config, dispatcher
        self.info = info or read_model(config.model)
        self.model_id = served_model_id(Path(self.info.path))
        self.weights = WeightControl(dispatcher.control)
        self.loras = LoraControl(dispatcher.control)
        self.pins = PinControl(self.weights)  # kl_reference "pinned"
        self.memory = MemorySync(config, dispatcher.control, self.weights, self.loras)
        experts = EXPERT_NAMES if self.info.has_transformer_2 else EXPERT_NAMES[:1]
        self.sleep = SleepControl(dispatcher, self.weights, experts)
        self.metrics = Metrics()
        self.pause = PauseGate()  # vLLM's /pause: new generations wait while it is paused
        self.in_flight = InFlight(dispatcher.pending, config.limits.max_attempts)
        self.cancels = Cancellations(dispatcher.cancel_partial, lambda why: self.metrics.cancelled.labels(why).inc())
        limits = config.limits
        # A job's progress is its request's, as GET /progress/{id} says.
        self.jobs = JobTable(store or JobStore(limits.data_dir), limits.max_jobs, limits.job_ttl_s,
                             self.in_flight.percent)
        dispatcher.cancelled = self.cancels.cancelled
        dispatcher.contract = self.info.family.contract  # answers are checked against the served family's tensors
        self.weights.versioned.on_supplied = self.loras.versioned.on_supplied = self._supplied
        dispatcher.on_worker_back = self._worker_back
        registry = dispatcher.registry
        self.metrics.watch(EngineState(
            workers=lambda: dispatcher.health()[1], jobs=self.jobs.counts, weights=lambda: self.weights.version,
            adapters=lambda: {n: a["lora_version"] for n, a in self.loras.table.items()},
            restarts=lambda: {key: len(w.dead_pids) for key, w in registry.workers.items()},
            shm=dispatcher.shm.counts))

    # --- start and stop -------------------------------------------------------------------------------
    async def start(self, rerun: Prepare) -> None:
        """Start the dispatcher, then run again the video jobs an earlier start left unfinished (``rerun``: how
        a stored job is checked and run again, the OpenAI API's)."""
        await self.dispatcher.start()
        self.jobs.start(rerun)

    async def stop(self) -> None:
        await self.jobs.stop()  # first: a job the stop interrupts stays unfinished, not failed
        await self.dispatcher.stop()

    async def _worker_back(self, worker) -> None:
        """A restarted denoise worker gets the weight updates and the adapters its predecessor held. What
        only the trainer's memory held (weights or adapters it pushed) it cannot get: it is stale, not
        routed to, until the trainer pushes each of those again."""
        if worker.role == LoraControl.role:
            self.pins.forget()  # it holds no pinned copy
            missing = await self.weights.replay(worker) | await self.loras.replay(worker)
            if missing:
                self.dispatcher.registry.lacks(worker.role, worker.index, missing)
        await self.sleep.worker_back(worker)  # one restarted while asleep stays asleep

    def _supplied(self, item: str) -> None:
        self.dispatcher.registry.supplied(LoraControl.role, item)
        self.sleep.supplied(item)

    # --- the model ------------------------------------------------------------------------------------
    def health(self) -> dict:
        """Whether every worker is ready (``ok``), the model, and each worker's state."""
        ok, workers = self.dispatcher.health()
        return {"ok": ok, "model": str(self.info.path), "family": self.info.family.family,
                "pipeline": self.info.family.pipeline, "workers": workers}

    def models(self) -> dict:
        """The served model, as OpenAI's model list. Engine extensions (the web page starts from them): the
        request fields' serving defaults, whether it makes videos or images, whether it takes an input image
        and how many (``max_images``), whether its output's size follows that image alone (``sized_by_image``),
        the field that scales its classifier-free guidance (``guidance_field``), and its videos' frame rate."""
        info = self.info
        return {"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": int(Path(info.path).stat().st_mtime),
             "owned_by": "disagg-diffusion", "family": info.family.family, "pipeline": info.family.pipeline,
             "defaults": info.defaults, "video": info.family.video, "guidance_field": info.family.cfg_field,
             "image_input": info.family.condition.image_input(info) or "none", "max_images": max_images(info),
             "sized_by_image": sized_by_image(info), "fps": info.fps}]}

    def sample_body_limit(self, rollout: bool = False) -> int:
        """A generation body's size limit; on a model that takes images, larger by their base64 (as many as it
        takes, and a last frame); a rollout's by initial latents of up to --max-image-bytes too (in base64)."""
        limits, condition = self.config.limits, self.info.family.condition
        one = 4 * -(-limits.max_image_bytes // 3)
        extra = one if rollout else 0
        if condition.image_input(self.info) is None:
            return limits.max_body_bytes + extra
        images = max(2, max_images(self.info) + (condition.last_image_input(self.info) is not None))
        return limits.max_body_bytes + images * one + extra

    # --- generating -----------------------------------------------------------------------------------
    def params_for(self, body: GenerateBody, images: dict[str, torch.Tensor] | None = None) -> GenerationParams:
        """The request's parameters, every check done (a bad field raises :class:`FieldError`); ``images``: its
        decoded pixels (:meth:`images_of`), which an edit model's default output size follows."""
        params = to_params(body, self.info, self.config.limits, self.config.cache, images)
        self.loras.check_name(body.lora_name)
        self.pins.check(params)
        if params.cache is not None:
            problem = cache_problem(params.cache.method, self.info.family, self.config.workers, self.info)
            if problem:
                raise FieldError("cache.method", problem)
        return params

    async def images_of(self, body: GenerateBody, names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """The request's images as RGB pixels (decoded off the event loop), by wire tensor: ``image`` as one
        image or a list (``image``, ``image.2``, ...), ``last_image``; checked already by :meth:`params_for`
        against what the model takes. ``names``: what the caller calls a field (errors)."""
        if self.info.family.condition.image_input(self.info) is None:
            return {}  # nothing worth decoding: the params' check refuses a model's unwanted image
        limits, names = self.config.limits, names or {}
        given = body.image if isinstance(body.image, list) else [body.image]
        items = [(wire, names.get("image", "image") + name.removeprefix("image"), value)
                 for (wire, name), value in zip(image_items(body.image), given)]
        if body.last_image is not None:
            items.append((LAST_IMAGE.name, names.get(LAST_IMAGE.name, LAST_IMAGE.name), body.last_image))
        out = {}
        for wire, name, value in items:
            pixels = await asyncio.to_thread(decode_image, value, name, max_bytes=limits.max_image_bytes,
                                             max_pixels=limits.max_image_pixels)
            out[wire] = torch.from_numpy(pixels)
        return out

    async def generate(self, body: GenerateBody, request_id: str, gone: Gone | None = None,
                       on_sample: OnSample | None = None) -> Generated:
        """A generation (a rollout: a :class:`RolloutBody`), its ``n`` samples one unit: checked, admitted (429
        when the engine is full), run, answered; cancelled (499) by :meth:`cancel` or when ``gone()`` returns.
        ``on_sample``: a streaming request's samples, each as it is decoded."""
        params, images = await self.prepare(body)
        return await self.generate_prepared(body, params, images, request_id, gone, on_sample)

    async def prepare(self, body: GenerateBody) -> tuple[GenerationParams, dict]:
        """A generation's checked parameters and what the encoder gets (its images); a bad field raises
        :class:`FieldError`, before anything is admitted."""
        pixels = await self.images_of(body)  # first: an edit model's default size follows its images
        params = self.params_for(body, pixels)
        return params, {**pixels, **initial_latents(body, self.info, params)}

    async def generate_prepared(self, body: GenerateBody, params: GenerationParams, images: dict, request_id: str,
                                gone: Gone | None = None, on_sample: OnSample | None = None) -> Generated:
        """:meth:`generate` after :meth:`prepare`."""
        started = time.perf_counter()
        outcome = await self.run(params, request_id, body.timeout_s, images, gone,
                                 partial=getattr(body, "return_partial", False), on_sample=on_sample)
        return Generated(params, outcome, started)

    async def run(self, params: GenerationParams, request_id: str, timeout_s: float | None,
                  images: dict | None = None, gone: Gone | None = None, partial: bool = False,
                  on_sample: OnSample | None = None) -> Outcome:
        """Run checked ``params`` under the caller's ``request_id`` (409 when it is in flight already)."""
        await self.pause.wait_open()
        with self.in_flight.claim(request_id):
            self.dispatcher.admit(params.n)
            return await self.cancels.run(request_id, self.submit(params, request_id, timeout_s, images, on_sample),
                                          gone, partial=partial)

    async def run_job(self, params: GenerationParams, timeout_s: float, images: dict | None,
                      started: Callable[[str], None]) -> Outcome:
        """A video job's run: it waits for room (429 only delays it) up to ``timeout_s``, then runs under a
        fresh id it reports to ``started``."""
        await self.pause.wait_open()
        await wait_for_room(lambda: self.dispatcher.admit(params.n), time.monotonic() + timeout_s)
        request_id = uuid.uuid4().hex
        started(request_id)
        return await self.cancels.run(request_id, self.submit(params, request_id, timeout_s, images))

    async def submit(self, params: GenerationParams, request_id: str, timeout_s: float | None,
                     images: dict | None = None, on_sample: OnSample | None = None) -> Outcome:
        """Run one admitted request (``images``: its pixels, image-to-video); its answer (and its metrics)."""
        t0 = time.perf_counter()
        outcome = await self.dispatcher.submit(params, request_id, timeout_s, versions=lambda: self._versions(params),
                                               images=images, on_sample=on_sample)
        self.metrics.generated(outcome.timings, outcome.info, params.n,
                               outcome.info.get("steps_done", params.num_inference_steps), time.perf_counter() - t0)
        return outcome

    def _versions(self, params: GenerationParams) -> tuple:
        """What a rollout's answer belongs to: the weight version, and its adapter's version."""
        return self.weights.version, self.loras.table.get(params.lora_name, {}).get("lora_version")

    def progress(self, request_id: str) -> dict:
        """Where a request in flight is (stage, step, 0-100); 404 once answered (or never sent)."""
        state = self.in_flight.state(request_id)
        if state is None:
            raise EngineError(404, "not_found", f"no request {request_id!r} is in flight (unknown, or answered "
                              "already)", "router", "")
        return {"id": request_id, "object": "request.progress", **state}

    def cancel(self, request_id: str) -> list[str]:
        """Cancel a request in flight (404 when none is); the ids cancelled."""
        return self.cancels.cancel(request_id)

    def abort_all(self) -> list[str]:
        """Cancel every request in flight; the ids of those not cancelled before."""
        return self.cancels.abort_all()

    async def delete_job(self, job_id: str) -> None:
        """Delete a video job (404 when unknown); one not yet ended is cancelled first."""
        if await self.jobs.delete(job_id):
            self.metrics.cancelled.labels(JOB_DELETED).inc()

    # --- weights --------------------------------------------------------------------------------------
    def check_weights_enabled(self) -> None:
        """403 unless the engine has weight roots (called before a body is read: nothing reaches a worker)."""
        if not self.config.weight_roots:
            raise EngineError(403, "forbidden", WEIGHTS_DISABLED, "router", "")

    def _module(self, module: str) -> str:
        return checked_module(module, self.info.has_transformer_2)

    async def update_weights_from_disk(self, module: str, path: str, checksum: bool = True) -> dict:
        self.check_weights_enabled()
        module = self._module(module)
        path = checked_weight_path("path", path, self.config.weight_roots)
        return await self.weights.update(module, path, checksum=checksum)

    async def weights_checksum(self, module: str) -> dict:
        return await self.weights.checksum(self._module(module))

    def check_memory_sync_enabled(self) -> None:
        """403 unless weight sync from memory is on (called before a body is read)."""
        self.memory.check_enabled()

    def weight_sync(self) -> dict:
        return self.memory.info()

    async def update_weights_from_tensors(self, body: UpdateWeightsFromTensorsBody) -> dict:
        self.check_memory_sync_enabled()
        self._module(body.module)
        return await self.memory.from_tensors(body)

    async def init_weights_group(self, body: InitWeightsGroupBody) -> dict:
        self.check_memory_sync_enabled()
        return await self.memory.init_group(body)

    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributedBody,
                                              typed: bool = False) -> dict:
        """``typed``: the trainer broadcasts each tensor in its own dtype, a bucket each (SGLang's trainers)."""
        self.check_memory_sync_enabled()
        self._module(body.module)
        return await self.memory.from_distributed(body, typed)

    async def destroy_weights_group(self) -> dict:
        self.check_memory_sync_enabled()
        return await self.memory.destroy_group()

    async def pin_reference(self) -> dict:
        """Every denoise worker's current weights as the reference of ``kl_reference: "pinned"``."""
        return await self.pins.pin()

    # --- LoRA adapters --------------------------------------------------------------------------------
    async def load_lora(self, body: LoadLoraBody | LoadLoraTensorsBody) -> dict:
        """An adapter from a path under a weight root, or from the tensors it comes with."""
        if isinstance(body, LoadLoraTensorsBody):
            return await self.loras.load_tensors(body)
        self.check_weights_enabled()
        checked_weight_path("lora_path", body.lora_path, self.config.weight_roots)
        return await self.loras.load_path(body)

    async def unload_lora(self, name: str) -> dict:
        return await self.loras.unload(name)

    def lora_adapters(self) -> dict:
        return self.loras.adapters()

    # --- sleep ----------------------------------------------------------------------------------------
    async def release_memory(self, tags: list[str] | None = None, level: int = 1, mode: str = "wait") -> dict:
        """Release the components ``tags`` names (none, or ``weights``: all)."""
        return await self.sleep.release(components_of(tags), level, mode)

    async def resume_memory(self, tags: list[str] | None = None, reload: str | None = None) -> dict:
        return await self.sleep.resume(components_of(tags), reload)

    def sleep_state(self) -> dict:
        return self.sleep.status()

"""The encoder, denoise and decode workers' path for any model family, in one process and without sockets.

The encoder's wire tensors -> the denoise worker's :class:`~denoise_worker.denoiser.Denoiser` (its tasks and
its batched steps) -> the family's decoder: the same objects the workers run, so that the family tests compare
the engine's own maths against diffusers' pipelines and the trainer's recompute fast.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion import text_roles
from common.diffusion.model_info import ModelInfo
from common.diffusion.parts.decoder import Decoded
from common.diffusion.params import family_values
from common.diffusion.policy import Policy
from common.families import read_model
from common.runtime.component_memory import settle_held
from common.protocol.messages import INITIAL_LATENTS, LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, GenerationParams
from denoise_worker.denoiser import Denoiser, Request
from denoise_worker.task import DenoiseTask

DTYPE = torch.float32
CPU = torch.device("cpu")
MAX_BATCH = 8  # the denoise worker's --max-batch-size default is larger; 8 still packs every test's rows


def gradient_picture(height: int, width: int, seed: int = 0):
    """A smooth RGB image (a gradient plus noise, as PIL), so that resampling it matters."""
    import numpy as np
    import PIL.Image

    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1)
    return PIL.Image.fromarray(((0.7 * base + 0.3 * rng.rand(height, width, 3)) * 255).astype(np.uint8))


def negative_for(info: ModelInfo, text: str) -> str | None:
    """``text`` as a request's negative prompt, or None on a model that refuses one (FLUX.2 [klein]: its CFG's
    negative is the empty prompt), as its family's guidance says."""
    refused = info.family.guidance.refusal(info, {"negative_prompt": text})
    return None if refused is not None and refused[0] == "negative_prompt" else text


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


class InProcess:
    """One model directory's engine path (see the module docstring)."""

    def __init__(self, model_dir: Path, transformer_file: Path | None = None):
        self.info: ModelInfo = read_model(model_dir, transformer_file)  # the file: as --transformer-file
        self.family = self.info.family
        self.encoder = self.family.text.load_encoder(self.info, DTYPE, CPU)
        self.policy = Policy.load(self.info, DTYPE, CPU)
        self.denoiser = Denoiser(self.policy, CPU, MAX_BATCH)
        self.decoder = self.family.decoder.load(self.info, DTYPE, CPU)
        self.images = None  # image-to-video models: the encoder worker's image side
        if self.family.condition.image_input(self.info) is not None:
            self.images = self.family.condition.load(self.info, DTYPE, CPU)
        # Laid out as the workers' (their ComponentMemory settles them): the same outputs, bit for bit.
        settle_held(encoder=self.encoder, decoder=self.decoder, images=self.images)

    @property
    def shared_forwards(self) -> int:
        """Forwards that held more than one task (batching tests)."""
        return self.denoiser.shared_forwards

    @property
    def max_threads(self) -> int:
        """The threads the eager CPU worker sizes its forwards up to (torch's when the harness was built)."""
        return self.denoiser.max_threads

    @max_threads.setter
    def max_threads(self, threads: int) -> None:  # as a worker given that many threads caps its forwards
        self.denoiser.max_threads = threads

    @property
    def serving_template(self):
        return self.denoiser.serving_template

    @property
    def rollout_template(self):
        return self.denoiser.rollout_template

    def params(self, **over) -> GenerationParams:
        """A request as the router fills it: the model's serving defaults for whatever ``over`` leaves out."""
        d = self.info.defaults
        fields = dict(prompt="a red fox in the snow", negative_prompt="", height=d["height"], width=d["width"],
                      num_frames=1, num_inference_steps=d["num_inference_steps"],
                      guidance_scale=float(d["guidance_scale"]), seed=0, max_sequence_length=d["max_sequence_length"])
        if self.family.cfg_field == "true_cfg_scale":
            fields["true_cfg_scale"] = float(d.get("true_cfg_scale", 1.0))
        own = {**fields, **over}  # the family's own fields travel in GenerationParams.fields
        own = {**family_values(own, self.info), **own}  # with their defaults, as the router fills them
        return GenerationParams(**{k: v for k, v in own.items() if k in GenerationParams.__struct_fields__},
                                fields={k: v for k, v in own.items() if k not in GenerationParams.__struct_fields__})

    def image_wire(self, p: GenerationParams, image, last_image=None) -> dict[str, torch.Tensor]:
        """The encoder worker's image tensors for a request with ``image`` (a PIL image, or a list of them for an
        edit model; as the router's pixels rebuild them; none: {})."""
        if image is None:
            return {}
        images = image if isinstance(image, list) else [image]
        return {k: t.clone() for k, t in self.family.condition.wire_tensors(self.images, images, last_image,
                                                                             p).items()}

    def task(self, p: GenerationParams, lora=None, image=None, last_image=None, initial_latents=None) -> DenoiseTask:
        """The encoder worker's wire tensors (prompt and negative in one call; the image side's for a request
        with ``image``), then the denoise worker's task."""
        guided = self.family.guidance.uses_cfg(p)
        texts = [(p.prompt, False), (p.negative_prompt, True)] if guided else [(p.prompt, False)]
        seen = None  # an edit model's text encoder sees the request's images
        if image is not None and self.family.condition.text_sees_images():
            seen = [image if isinstance(image, list) else [image]] * len(texts)
        wires = [{k: t.clone() for k, t in w.items()} for w in text_roles.encode(self.encoder, texts,
                                                                                  p.max_sequence_length, seen)]
        tensors = {**wires[0], **self.image_wire(p, image, last_image)}
        if guided:
            tensors.update({self.family.text.negatives()[k]: t for k, t in wires[1].items()})
        if initial_latents is not None:
            tensors[INITIAL_LATENTS.name] = initial_latents
        return self.denoiser.task(p, tensors, lora=lora)

    @torch.no_grad()
    def step(self, tasks: list[DenoiseTask]) -> None:
        """One step of the worker's loop for ``tasks`` (each at its own step): the Denoiser's step for them as one
        batch (denoise_worker/denoiser.py ``Denoiser.run``); none may fail."""
        left = self.denoiser.run([Request(str(i), t) for i, t in enumerate(tasks)])
        assert all(out.error is None for out in left), [out.error for out in left]

    def run(self, p: GenerationParams, lora=None, image=None, last_image=None, initial_latents=None) -> DenoiseTask:
        """Request ``p`` alone, to its last step (``initial_latents``: resumed from them)."""
        task = self.task(p, lora, image, last_image, initial_latents)
        while not task.done:
            self.step([task])
        return task

    def frames(self, latents: torch.Tensor, p: GenerationParams) -> torch.Tensor:
        return self.decoded(latents, p).frames

    def decoded(self, latents: torch.Tensor, p: GenerationParams) -> Decoded:
        """The decode worker's output for a request's final latents: frames (and a sound model's waveform)."""
        made = self.family.latents.size(self.info, p.height, p.width, p.fields)
        if hasattr(self.decoder, "decode_rows"):  # a decoder that reads its requests (LTX-2's)
            return self.decoder.decode_rows(latents, [(p, i) for i in range(latents.shape[0])], *made)
        return Decoded(self.decoder.decode(self.family.latents.unpack(latents, self.info, *made), p.height, p.width))


def compare_tasks(a: DenoiseTask, b: DenoiseTask) -> float:
    """The largest difference between two tasks' latents, log-probs and trajectories."""
    ea, eb = a.extras(), b.extras()
    diffs = [max_diff(a.latents, b.latents)]
    for name in (LOG_PROBS.name, TRAJECTORY_LATENTS.name):
        if name in ea:
            diffs.append(max_diff(ea[name], eb[name]) if ea[name].numel() else 0.0)
    if LOG_PROB_STEPS.name in ea:
        assert torch.equal(ea[LOG_PROB_STEPS.name], eb[LOG_PROB_STEPS.name])
    return max(diffs)


class InStage:
    """A denoise worker's own stage (``DenoiseStage``: its batch choice, its forwards, its failure path) in this
    process, fed the encoder worker's wire tensors as a denoise message brings them (``eng``'s encoder and image
    side); what it answers is what the worker would send on."""

    def __init__(self, eng: InProcess, runtime_dir: Path, max_batch: int = MAX_BATCH):
        from common.config.engine import EngineConfig, WorkerSpec
        from denoise_worker.stage import DenoiseStage

        self.eng = eng
        config = EngineConfig(model=str(eng.info.path), workers=[WorkerSpec(role="denoise", index=0)],
                              router_endpoint="", runtime_dir=str(runtime_dir), max_batch_size=max_batch)
        self.stage = DenoiseStage(config, config.workers[0])
        self.stage.load()

    def message(self, request_id: str, p: GenerationParams, image=None, last_image=None):
        """The denoise message of request ``p`` and its tensors (prompt and negative prompt in one encoder call)."""
        from common.protocol.messages import PROTOCOL_VERSION, DenoiseRequest, Route

        guided = self.eng.family.guidance.uses_cfg(p)
        texts = [(p.prompt, False), (p.negative_prompt, True)] if guided else [(p.prompt, False)]
        seen = None  # an edit model's text encoder sees the request's images, as in InProcess.task
        if image is not None and self.eng.family.condition.text_sees_images():
            seen = [image if isinstance(image, list) else [image]] * len(texts)
        wires = text_roles.encode(self.eng.encoder, texts, p.max_sequence_length, seen)
        tensors = {k: t.clone() for k, t in wires[0].items()}
        if guided:
            twin = self.eng.family.text.negatives()
            tensors.update({twin[k]: t.clone() for k, t in wires[1].items()})
        tensors.update(self.eng.image_wire(p, image, last_image))
        msg = DenoiseRequest(v=PROTOCOL_VERSION, request_id=request_id, route=Route(encoder=0, denoise=0, decode=0),
                             params=p)
        return msg, tensors

    def serve(self, requests: dict[str, tuple[GenerationParams, object]], last_image=None) -> dict:
        """Every request (id -> (params, image or None)) held at once, the worker's turns until none is left:
        per id, what the stage sent on (a ``Forward``) or the error it answered with."""
        for rid, (p, image) in requests.items():
            self.stage.accept(*self.message(rid, p, image, last_image))
        out = {}
        while self.stage.has_work():
            for msg, outcome in self.stage.work():
                assert msg.request_id not in out  # one answer per request
                out[msg.request_id] = outcome
        assert set(out) == set(requests)
        return out


class ModuleModels:
    """What a family test module builds once per model directory (the in-process engine path, diffusers' own
    pipeline for it, the trainer's policy), dropped by :meth:`clear` at the module's end."""

    def __init__(self):
        self.engines: dict[str, InProcess] = {}
        self.pipes: dict[str, object] = {}
        self.trainers: dict[str, object] = {}

    def engine(self, model_dir: Path) -> InProcess:
        if str(model_dir) not in self.engines:
            self.engines[str(model_dir)] = InProcess(model_dir)
        return self.engines[str(model_dir)]

    def pipe(self, model_dir: Path, pipeline: str | None = None):
        """The family's diffusers pipeline on ``model_dir`` (or pipeline class ``pipeline``, loading the same
        directory), laid out as the engine's weights (reference_pipeline)."""
        import diffusers
        from conftest import reference_pipeline

        pipeline = pipeline or read_model(model_dir).family.pipeline
        if (str(model_dir), pipeline) not in self.pipes:
            cls = getattr(diffusers, pipeline)
            self.pipes[str(model_dir), pipeline] = reference_pipeline(cls.from_pretrained(model_dir, dtype=DTYPE))
        return self.pipes[str(model_dir), pipeline]

    def trainer(self, model_dir: Path):
        from rl import TrainerPolicy

        if str(model_dir) not in self.trainers:
            self.trainers[str(model_dir)] = TrainerPolicy(model_dir)
        return self.trainers[str(model_dir)]

    def clear(self) -> None:
        for made in (self.engines, self.pipes, self.trainers):
            made.clear()

    def module_scope(self, *also: dict):
        """The body of a test module's autouse fixture (``yield from models.module_scope(...)``): torch's thread
        count as it was (the workers' sizing changes it), then these models and the ``also`` caches dropped."""
        threads = torch.get_num_threads()
        yield
        torch.set_num_threads(threads)
        for made in also:
            made.clear()
        self.clear()

"""The encoder and denoise workers' path for one model directory in this process, in a chosen dtype.

What the workers run, without sockets: the encoder worker's wire tensors (``text_roles.encode``, the image
side's ``wire_tensors``), the denoise worker's conditioning (``TextTable``), task (``DenoiseTask``) and
batched forwards (``step_velocities``, the worker's thread sizing) and steps (``advance_all``). Each component
is loaded in ``dtype`` as a worker started with ``--dtype`` loads it (``torch_dtype_for``), so a bench can set
the engine's numbers in bfloat16 beside float32 ones on the same directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion import schedulers, text_roles
from common.diffusion.cache_signals import teacache_settings
from common.diffusion.policy import Policy
from common.families import read_model
from common.protocol.messages import GenerationParams
from common.runtime.component_memory import settle_held
from denoise_worker.caching import request_cache
from denoise_worker.forward import step_velocities
from denoise_worker.joint_step import advance_all
from denoise_worker.task import DenoiseTask
from denoise_worker.texts import TextTable
from denoise_worker.threads import size_threads

CPU = torch.device("cpu")


class EnginePath:
    """One model directory's encoder and denoise path in ``dtype`` (see the module docstring)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, max_batch: int = 8):
        self.info = read_model(model_dir)
        self.family = self.info.family
        self.dtype, self.max_batch = dtype, max_batch
        self.encoder = self.family.text.load_encoder(self.info, dtype, CPU)
        self.policy = Policy.load(self.info, dtype, CPU)
        self.texts = TextTable(self.family, CPU, self.policy.dtype)
        self.serving = schedulers.load_serving_template(self.info)
        self.rollout = schedulers.rollout_template_for(self.serving)
        self.images = None  # the encoder worker's image side, where the model takes an image
        if self.family.condition.image_input(self.info) is not None:
            self.images = self.family.condition.load(self.info, dtype, CPU)
        settle_held(encoder=self.encoder, images=self.images)  # laid out as the workers' components
        self.max_threads = torch.get_num_threads()

    def task(self, p: GenerationParams, image=None) -> DenoiseTask:
        """The encoder worker's tensors for request ``p`` (``image``: a PIL image, or a list for an edit model),
        then the denoise worker's task."""
        guided = self.family.guidance.uses_cfg(p)
        texts = [(p.prompt, False), (p.negative_prompt, True)] if guided else [(p.prompt, False)]
        images = None if image is None else (image if isinstance(image, list) else [image])
        seen = [images] * len(texts) if images is not None and self.family.condition.text_sees_images() else None
        wires = text_roles.encode(self.encoder, texts, p.max_sequence_length, seen)
        pixels = {} if images is None else self.family.condition.wire_tensors(self.images, images, None, p)
        beside = {k: t for k, t in pixels.items() if k in self.family.condition.text_fields}
        cond = self.texts.conditioning({**wires[0], **beside}, p.max_sequence_length)
        uncond = self.texts.conditioning({**wires[1], **beside}, p.max_sequence_length) if guided else None
        task = DenoiseTask.create(p, cond, uncond, self.info, self.serving, self.rollout, CPU,
                                  image=self.family.condition.from_wire(pixels))
        task.cache = request_cache(task, teacache_settings(self.info))
        return task

    @torch.no_grad()
    def run(self, p: GenerationParams, image=None) -> DenoiseTask:
        """Request ``p`` alone, to its last step, as the denoise worker runs it."""
        task = self.task(p, image)
        tokens = self.family.latents.image_seq_len(self.info, p.height, p.width, p.num_frames)

        def before(inputs):  # the eager CPU worker's thread sizing for the forward's size
            size_threads(self.policy.experts[self.policy.expert_for(inputs[0].timestep)], inputs, self.max_threads,
                         tokens + self.family.condition.extra_tokens(inputs[0].image))
        while not task.done:
            velocities = step_velocities(self.policy, [task], self.max_batch, before)
            assert advance_all([task], velocities) == [None]
        torch.set_num_threads(self.max_threads)
        return task

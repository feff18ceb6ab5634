"""The encoder and denoise workers' path for one model directory in this process, in a chosen dtype.

What the workers run, without sockets: the encoder worker's wire tensors (``text_roles.encode``, the image
side's ``wire_tensors``), then the denoise worker's :class:`~denoise_worker.denoiser.Denoiser` (its tasks, its
batched steps, its thread sizing). Each component
is loaded in ``dtype`` as a worker started with ``--dtype`` loads it (``torch_dtype_for``), so a bench can set
the engine's numbers in bfloat16 beside float32 ones on the same directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion import text_roles
from common.diffusion.policy import Policy
from common.families import read_model
from common.protocol.messages import GenerationParams
from common.runtime.component_memory import settle_held
from denoise_worker.denoiser import Denoiser
from denoise_worker.task import DenoiseTask

CPU = torch.device("cpu")


class EnginePath:
    """One model directory's encoder and denoise path in ``dtype`` (see the module docstring)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, max_batch: int = 8):
        self.info = read_model(model_dir)
        self.family = self.info.family
        self.dtype, self.max_batch = dtype, max_batch
        self.encoder = self.family.text.load_encoder(self.info, dtype, CPU)
        self.policy = Policy.load(self.info, dtype, CPU)
        self.denoiser = Denoiser(self.policy, CPU, max_batch)
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
        tensors = {**wires[0], **pixels}
        if guided:
            tensors.update({self.family.text.negatives()[k]: t for k, t in wires[1].items()})
        return self.denoiser.task(p, tensors)

    @torch.no_grad()
    def run(self, p: GenerationParams, image=None) -> DenoiseTask:
        """Request ``p`` alone, to its last step, as the denoise worker runs it."""
        task = self.denoiser.add("bench", self.task(p, image)).task
        while self.denoiser.requests:
            assert all(out.error is None for out in self.denoiser.step())
        torch.set_num_threads(self.max_threads)
        return task

"""SD3's text conditioning: CLIP-L, CLIP-G and T5, joined as ``StableDiffusion3Pipeline.encode_prompt`` joins them.

Encoded with diffusers' own ``encode_prompt`` on a text-only pipeline
(:class:`~common.diffusion.parts.pipeline_text.PipelineTextEncoder`): the two CLIP models' penultimate hidden
states joined on the feature axis and zero-padded to T5's width, then T5's sequence after them; the CLIP pooled
outputs joined into ``pooled_projections``. A prompt travels in full ([77 + max_sequence_length, D] and [P]):
unlike Wan's, its padding tokens carry values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.diffusion.parts.pipeline_text import PipelineTextEncoder
from common.diffusion.parts.text import POOLED_PROMPT_EMBEDS
from common.protocol.messages import PROMPT_EMBEDS


class SD3TextEncoder(PipelineTextEncoder):
    PIPELINE = "StableDiffusion3Pipeline"
    ENCODERS = {"text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
                "text_encoder_3": "T5EncoderModel"}

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "SD3TextEncoder":
        # SD3 checkpoints may leave T5 out (the pipeline then pads with zeros); the engine serves it with T5.
        if not (Path(model_dir) / "text_encoder_3").is_dir():
            raise FileNotFoundError(f"{model_dir}: no text_encoder_3 (T5); the engine serves SD3 with its T5 encoder")
        return super().load(model_dir, dtype, device)

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, 77 + max_sequence_length, D], pooled [B, P]) for many prompts in one call."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
        return embeds, pooled

    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        embeds, pooled = self.encode(prompts, max_sequence_length)
        return [{PROMPT_EMBEDS.name: embeds[i], POOLED_PROMPT_EMBEDS.name: pooled[i]} for i in range(len(prompts))]

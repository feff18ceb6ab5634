"""FLUX's text conditioning: CLIP-L's pooled output and T5's hidden states, with ``FluxPipeline.encode_prompt``.

Encoded with diffusers' own ``encode_prompt`` on a text-only pipeline
(:class:`~common.diffusion.parts.pipeline_text.PipelineTextEncoder`). A prompt travels in full
([max_sequence_length, D] and [P]): T5's padding tokens carry values the transformer attends to.
"""

from __future__ import annotations

import torch

from common.diffusion.parts.pipeline_text import PipelineTextEncoder
from common.diffusion.parts.text import POOLED_PROMPT_EMBEDS
from common.protocol.messages import PROMPT_EMBEDS


class FluxTextEncoder(PipelineTextEncoder):
    PIPELINE = "FluxPipeline"
    ENCODERS = {"text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"}

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    max_sequence_length=max_sequence_length)
        return [{PROMPT_EMBEDS.name: embeds[i], POOLED_PROMPT_EMBEDS.name: pooled[i]} for i in range(len(prompts))]

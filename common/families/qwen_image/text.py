"""Qwen-Image's text conditioning: Qwen2.5-VL with ``QwenImagePipeline.encode_prompt``.

diffusers formats each prompt into its system template, runs the text encoder, keeps the last hidden state
of the real tokens and drops the template's prefix tokens. A prompt travels as those rows alone
([L, D], L at most ``max_sequence_length``); the denoise worker pads texts of different lengths in one
forward and masks the padding, as the pipeline does for a batch of prompts.
"""

from __future__ import annotations

import torch

from common.diffusion.parts.pipeline_text import PipelineTextEncoder
from common.protocol.messages import PROMPT_EMBEDS


class QwenImageTextEncoder(PipelineTextEncoder):
    PIPELINE = "QwenImagePipeline"
    ENCODERS = {"text_encoder": "Qwen2_5_VLForConditionalGeneration"}

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=max_sequence_length)
        lengths = [embeds.shape[1]] * len(prompts) if mask is None else mask.sum(dim=1).tolist()
        return [{PROMPT_EMBEDS.name: embeds[i, : int(lengths[i])]} for i in range(len(prompts))]

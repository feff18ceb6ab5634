"""Z-Image's text conditioning: Qwen3 with ``ZImagePipeline.encode_prompt``.

The pipeline wraps each prompt in the tokenizer's chat template (one user turn, the generation prompt, thinking
on), runs the text encoder and keeps the second-to-last hidden state of the real tokens only. A prompt travels
as those rows ([L, D], its own length); the transformer takes a list of them, so texts of different lengths
share a forward (the denoise worker pads them with a mask that the transformer part turns back into the list).
"""

from __future__ import annotations

import torch

from common.diffusion.parts.pipeline_text import PipelineTextEncoder
from common.protocol.messages import PROMPT_EMBEDS


class ZImageTextEncoder(PipelineTextEncoder):
    PIPELINE = "ZImagePipeline"
    ENCODERS = {"text_encoder": "Qwen3Model"}

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        # A copy: the pipeline writes the templated prompts into the list it is given.
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=max_sequence_length)
        return [{PROMPT_EMBEDS.name: e} for e in embeds]

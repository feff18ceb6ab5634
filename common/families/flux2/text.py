"""FLUX.2 [klein]'s text conditioning: ``Flux2KleinPipeline.encode_prompt`` on a text-only pipeline.

Qwen3's hidden states of the pipeline's ``text_encoder_out_layers`` (9, 18, 27) stacked on the feature axis, for
the prompt in Qwen3's chat template padded to ``max_sequence_length``: a prompt travels in full
([max_sequence_length, 3 * hidden]), as the transformer attends to every padding token (it takes no mask).
"""

from __future__ import annotations

import torch

from common.diffusion.parts.pipeline_text import PipelineTextEncoder
from common.protocol.messages import PROMPT_EMBEDS


class Flux2KleinTextEncoder(PipelineTextEncoder):
    PIPELINE = "Flux2KleinPipeline"
    ENCODERS = {"text_encoder": "Qwen3ForCausalLM"}

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                            max_sequence_length=max_sequence_length)
        return [{PROMPT_EMBEDS.name: embeds[i]} for i in range(len(prompts))]

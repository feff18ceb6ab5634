"""FLUX's text conditioning: CLIP-L's pooled output and T5's hidden states, with ``FluxPipeline.encode_prompt``.

The encoder worker and a trainer (``rl.TrainerPolicy``) both encode here, with diffusers' own
``encode_prompt`` on a text-only pipeline. A prompt travels in full ([max_sequence_length, D] and
[P]): T5's padding tokens carry values the transformer attends to.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.protocol.messages import POOLED_PROMPT_EMBEDS, PROMPT_EMBEDS


class FluxTextEncoder:
    def __init__(self, pipe):
        self.pipe = pipe  # a FluxPipeline holding only the tokenizers and text encoders
        self.device = pipe.text_encoder.device

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "FluxTextEncoder":
        # Imported here: the other stages need none of transformers' models.
        from diffusers import FluxPipeline
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        path = Path(model_dir)
        clip = CLIPTextModel.from_pretrained(path / "text_encoder", dtype=dtype)
        t5 = T5EncoderModel.from_pretrained(path / "text_encoder_2", dtype=dtype)
        pipe = FluxPipeline(
            scheduler=None, vae=None, transformer=None,
            tokenizer=AutoTokenizer.from_pretrained(path / "tokenizer"),
            tokenizer_2=AutoTokenizer.from_pretrained(path / "tokenizer_2"),
            text_encoder=clip.to(device).eval().requires_grad_(False),
            text_encoder_2=t5.to(device).eval().requires_grad_(False))
        return cls(pipe)

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    max_sequence_length=max_sequence_length)
        return [{PROMPT_EMBEDS.name: embeds[i], POOLED_PROMPT_EMBEDS.name: pooled[i]} for i in range(len(prompts))]

"""SANA's text conditioning: Gemma2 with ``SanaPipeline.encode_prompt``.

The pipeline puts its complex human instruction before each prompt (not before a negative prompt), encodes
the prompt padded to the instruction's length plus ``max_sequence_length``, and keeps the first token and the
last ``max_sequence_length - 1``, with their attention mask; a negative prompt is encoded alone at
``max_sequence_length`` tokens. The padding is at the end of each row, so a prompt travels as its real rows
alone ([L, D], L = the mask's sum); the denoise worker pads it back and rebuilds the mask.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from common.protocol.messages import PROMPT_EMBEDS
from common.diffusion.loading import load_component


def complex_human_instruction() -> list[str]:
    """``SanaPipeline.__call__``'s default instruction (the one a request gets)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


class SanaTextEncoder:
    negative_apart = True  # a negative prompt is encoded without the instruction: its own encoder call

    def __init__(self, pipe):
        self.pipe = pipe  # a SanaPipeline holding only the tokenizer and text encoder
        self.device = pipe.text_encoder.device
        self.instruction = complex_human_instruction()

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "SanaTextEncoder":
        from diffusers import SanaPipeline
        from transformers import AutoModel, AutoTokenizer

        path = Path(model_dir)
        encoder = load_component(AutoModel, path / "text_encoder", dtype)
        pipe = SanaPipeline(tokenizer=AutoTokenizer.from_pretrained(path / "tokenizer"),
                            text_encoder=encoder.to(device).eval().requires_grad_(False), vae=None, transformer=None,
                            scheduler=None)
        return cls(pipe)

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int,
                     negative: bool = False) -> list[dict[str, torch.Tensor]]:
        if negative:  # encode_prompt's negative branch: no instruction, no selection
            embeds, mask = self.pipe._get_gemma_prompt_embeds(
                prompts, self.device, self.pipe.text_encoder.dtype, clean_caption=False,
                max_sequence_length=max_sequence_length, complex_human_instruction=False)
        else:
            embeds, mask, _, _ = self.pipe.encode_prompt(
                prompts, do_classifier_free_guidance=False, device=self.device, clean_caption=False,
                max_sequence_length=max_sequence_length, complex_human_instruction=self.instruction)
        lengths = mask.sum(dim=1).tolist()
        return [{PROMPT_EMBEDS.name: embeds[i, : int(lengths[i])]} for i in range(len(prompts))]

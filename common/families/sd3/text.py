"""SD3's text conditioning: CLIP-L, CLIP-G and T5, joined as ``StableDiffusion3Pipeline.encode_prompt`` joins them.

The encoder worker and a trainer (``rl.TrainerPolicy``) both encode here, with diffusers' own
``encode_prompt`` on a text-only pipeline: the two CLIP models' penultimate hidden states joined on the
feature axis and zero-padded to T5's width, then T5's sequence after them; the CLIP pooled outputs
joined into ``pooled_projections``. A prompt travels in full ([77 + max_sequence_length, D] and [P]):
unlike Wan's, its padding tokens carry values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.protocol.messages import POOLED_PROMPT_EMBEDS, PROMPT_EMBEDS


class SD3TextEncoder:
    def __init__(self, pipe):
        self.pipe = pipe  # a StableDiffusion3Pipeline holding only the tokenizers and text encoders
        self.device = pipe.text_encoder.device

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "SD3TextEncoder":
        # Imported here: the other stages need none of transformers' models.
        from diffusers import StableDiffusion3Pipeline
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        path = Path(model_dir)
        parts = {}
        for i, suffix in enumerate(("", "_2")):
            parts[f"tokenizer{suffix}"] = AutoTokenizer.from_pretrained(path / f"tokenizer{suffix}")
            parts[f"text_encoder{suffix}"] = CLIPTextModelWithProjection.from_pretrained(
                path / f"text_encoder{suffix}", dtype=dtype)
        if not (path / "text_encoder_3").is_dir():
            raise FileNotFoundError(f"{path}: no text_encoder_3 (T5); the engine serves SD3 with its T5 encoder")
        parts["tokenizer_3"] = AutoTokenizer.from_pretrained(path / "tokenizer_3")
        parts["text_encoder_3"] = T5EncoderModel.from_pretrained(path / "text_encoder_3", dtype=dtype)
        for name, part in parts.items():
            if name.startswith("text_encoder"):
                parts[name] = part.to(device).eval().requires_grad_(False)
        pipe = StableDiffusion3Pipeline(transformer=None, scheduler=None, vae=None, **parts)
        return cls(pipe)

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

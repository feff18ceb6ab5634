"""Wan's text conditioning: prompt cleaning, the UMT5 encoder, and the padding the transformer expects.

The encoder worker and a trainer (``rl.TrainerPolicy``) both build a prompt's
conditioning here, so that the trainer's recompute sees exactly the
embeddings the engine's transformer saw.
"""

from __future__ import annotations

import html
from pathlib import Path

import regex
import torch

from common.diffusion.parts.text import pad_embeddings
from common.protocol.messages import PROMPT_EMBEDS
from common.diffusion.loading import load_component

MAX_SEQUENCE_LENGTH = 512  # WanPipeline's default

try:  # diffusers fixes mojibake with ftfy when it is installed; so do we
    import ftfy
except ImportError:  # pragma: no cover - ftfy is a declared dependency
    ftfy = None

_SPACES = regex.compile(r"\s+")


def clean_prompt(text: str) -> str:
    """Normalise a prompt the way Wan's pipeline does before tokenizing."""
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return _SPACES.sub(" ", text).strip()


def conditioning(prompt_embeds: torch.Tensor, negative_embeds: torch.Tensor | None,
                 device: torch.device | str, dtype: torch.dtype,
                 length: int = MAX_SEQUENCE_LENGTH) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded (cond, uncond) for the transformer from trimmed [L, D] embeddings (uncond None: no guidance)."""
    cond = pad_embeddings(prompt_embeds, length).to(device, dtype)
    uncond = None if negative_embeds is None else pad_embeddings(negative_embeds, length).to(device, dtype)
    return cond, uncond


class WanTextEncoder:
    """The tokenizer and UMT5 encoder of one Wan model directory."""

    def __init__(self, tokenizer, model):
        self.tokenizer = tokenizer
        self.model = model

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> "WanTextEncoder":
        # Imported here: the denoise worker needs only the padding above, not transformers' models.
        from transformers import AutoTokenizer, UMT5EncoderModel

        path = Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
        model = load_component(UMT5EncoderModel, path / "text_encoder", dtype)
        return cls(tokenizer, model.to(device).eval().requires_grad_(False))

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> list[torch.Tensor]:
        """Embeddings [L_i, D] for many prompts in one encoder call, each trimmed to its real length.

        Every prompt is padded to ``max_sequence_length`` tokens with its attention mask, exactly as
        diffusers' Wan pipeline does: all rows then have the same shape, so a
        prompt's embeddings are the same whatever else shares the call.
        """
        tokens = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask
        lengths = mask.gt(0).sum(dim=1).tolist()
        device = self.model.device
        hidden = self.model(tokens.input_ids.to(device), mask.to(device)).last_hidden_state.to(self.model.dtype)
        return [hidden[i, :n] for i, n in enumerate(lengths)]

    def encode_one(self, prompt: str, max_sequence_length: int = MAX_SEQUENCE_LENGTH) -> torch.Tensor:
        """Embeddings [L, D] of one prompt."""
        return self.encode([prompt], max_sequence_length)[0]

    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        """Each prompt's trimmed embeddings as they travel to the denoise worker."""
        return [{PROMPT_EMBEDS.name: e} for e in self.encode(prompts, max_sequence_length)]

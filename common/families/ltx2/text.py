"""LTX-2's text conditioning: Gemma3's hidden states of every layer through the pipeline's text connectors.

``LTX2Pipeline`` tokenizes each prompt (stripped, left-padded to ``max_sequence_length``, the pad token the
EOS one where the tokenizer has none: ``encode_prompt``), stacks the encoder's hidden states of every layer,
and runs ``connectors(embeds, mask, padding_side=...)``: a video context [L, D_v], an audio context [L, D_a]
and the mask over their L tokens (all ones where the connectors replace padding with learned registers, as the
real checkpoints do). A prompt travels as those three tensors, the full budget long; the transformer takes
them as ``encoder_hidden_states``, ``audio_encoder_hidden_states`` and ``encoder_attention_mask`` (the same mask
serves ``audio_encoder_attention_mask``). The connectors treat each row on its own, so a prompt's tensors do
not depend on which prompts share its encoder batch (tests/test_ltx2_parts.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from common.diffusion.parts.text import HIDDEN, TextCond, TextPart
from common.diffusion.request_fields import max_sequence_length
from common.protocol.messages import PROMPT_EMBEDS, PROMPT_MASK
from common.protocol.tensor_field import FLOAT_DTYPES, prompt_tensor
from common.diffusion.loading import load_component

AUDIO_HIDDEN = "audio_encoder_hidden_states"
AUDIO_PROMPT_EMBEDS = prompt_tensor("audio_prompt_embeds", FLOAT_DTYPES, 2)  # the audio stream's context [L, D_a]
MASK = "encoder_attention_mask"
DEFAULT_MAX_SEQUENCE_LENGTH = 1024  # LTX2Pipeline.__call__'s
# The pipeline bounds the budget by nothing but its connectors' rotary base (4096 in the real checkpoints,
# beyond which positions extrapolate); a budget must also be a multiple of the connectors' registers.
MAX_SEQUENCE_LENGTH = max_sequence_length(4096)


class Ltx2TextEncoder:
    """The tokenizer, Gemma3 and the connectors, in an ``LTX2Pipeline`` that holds nothing else."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.device = pipe.text_encoder.device
        registers = pipe.connectors.config.video_connector_num_learnable_registers
        self.registers = int(registers or 1)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device) -> "Ltx2TextEncoder":
        import diffusers
        import transformers
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

        path = Path(model_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path / "tokenizer")
        encoder = load_component(transformers.Gemma3ForConditionalGeneration, path / "text_encoder", dtype)
        connectors = load_component(LTX2TextConnectors, path / "connectors", dtype)
        parts = {name: m.to(device).eval().requires_grad_(False)
                 for name, m in (("text_encoder", encoder), ("connectors", connectors))}
        none = dict.fromkeys(("scheduler", "vae", "audio_vae", "transformer", "vocoder"))
        return cls(diffusers.LTX2Pipeline(tokenizer=tokenizer, **parts, **none))

    @torch.no_grad()
    def wire_tensors(self, prompts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        if max_sequence_length % self.registers:
            raise ValueError(f"max_sequence_length must be a multiple of {self.registers} on this model (its text "
                             f"connectors' learned registers), got {max_sequence_length}")
        embeds, mask, _, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False,
                                                     max_sequence_length=max_sequence_length, device=self.device)
        # encode_prompt has set the tokenizer's padding side; the pipeline's __call__ reads it back the same way.
        side = getattr(self.pipe.tokenizer, "padding_side", "left")
        video, audio, out_mask = self.pipe.connectors(embeds, mask, padding_side=side)
        return [{PROMPT_EMBEDS.name: video[i], AUDIO_PROMPT_EMBEDS.name: audio[i], PROMPT_MASK.name: out_mask[i]}
                for i in range(len(prompts))]


def load_text_encoder(info, dtype: torch.dtype, device) -> Ltx2TextEncoder:
    return Ltx2TextEncoder.load(info.path, dtype, device)


def example_text(info, model, max_sequence_length: int, generator, device, dtype) -> TextCond:
    """Random contexts of the widths ``model`` (the transformer) projects from, and a full mask."""
    width = int(model.config.caption_channels)
    shape = (1, max_sequence_length, width)
    return TextCond({HIDDEN: torch.randn(shape, generator=generator, device=device, dtype=dtype),
                     AUDIO_HIDDEN: torch.randn(shape, generator=generator, device=device, dtype=dtype),
                     MASK: torch.ones(1, max_sequence_length, device=device, dtype=dtype)})


@dataclass(frozen=True, kw_only=True)
class Ltx2Text(TextPart):
    """The three wire tensors as the transformer's keywords; texts of other budgets share a forward padded
    after their tokens with the mask 0 there (the transformer's cross-attention has no positions on the text
    side, so a masked tail leaves a row's output what it is alone)."""

    fields: tuple = (PROMPT_EMBEDS, AUDIO_PROMPT_EMBEDS, PROMPT_MASK)
    keywords: tuple[str, ...] = (HIDDEN, AUDIO_HIDDEN, MASK)
    load_encoder: object = load_text_encoder
    example: object = example_text
    masks_padding: bool = True

    def stack(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return self.padded_to({k: _cat_padded([t[k] for t in texts]) for k in self.keywords}, 1)

    def padded_to(self, texts: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
        extra = -texts[HIDDEN].shape[1] % multiple
        if not extra:
            return texts
        return {k: _pad_tokens(v, v.shape[1] + extra) for k, v in texts.items()}


def _pad_tokens(t: torch.Tensor, length: int) -> torch.Tensor:
    """[1 or U, L, ...] zero-padded after its L tokens to ``length`` (a mask's 0: not attended)."""
    pad = [0, 0] * (t.dim() - 2) + [0, length - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def _cat_padded(ts: list[torch.Tensor]) -> torch.Tensor:
    longest = max(t.shape[1] for t in ts)
    return torch.cat([_pad_tokens(t, longest) for t in ts])


TEXT = Ltx2Text()

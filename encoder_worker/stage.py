"""Encoder stage: prompt cleaning, tokenization and the UMT5 text encoder."""

from __future__ import annotations

import html
import time

import regex
import torch
from transformers import AutoTokenizer, UMT5EncoderModel

from common.messages import PROTOCOL_VERSION, DenoiseRequest, EncodeRequest
from common.model import MAX_SEQUENCE_LENGTH, ModelInfo
from common.worker import Forward, Stage

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


@torch.no_grad()
def encode_prompt(tokenizer, text_encoder, prompt: str) -> torch.Tensor:
    """Embeddings [L, D] trimmed to the prompt's real token length (trainers use this too)."""
    tokens = tokenizer(
        [clean_prompt(prompt)],
        padding="max_length",
        max_length=MAX_SEQUENCE_LENGTH,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask
    length = int(mask.gt(0).sum())
    device = text_encoder.device
    hidden = text_encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state
    return hidden[0, :length].to(text_encoder.dtype)


def load_text_encoder(model_dir, dtype: torch.dtype, device) -> tuple:
    info = ModelInfo.read(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(info.path / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(info.path / "text_encoder", dtype=dtype)
    return tokenizer, text_encoder.to(device).eval().requires_grad_(False)


class EncoderStage(Stage):
    role = "encoder"

    def load(self) -> None:
        self.tokenizer, self.text_encoder = load_text_encoder(self.config.model, self.dtype, self.device)

    def encode(self, prompt: str) -> torch.Tensor:
        return encode_prompt(self.tokenizer, self.text_encoder, prompt)

    def process(self, msg: EncodeRequest, tensors: dict[str, torch.Tensor]) -> Forward:
        t0 = time.perf_counter()
        p = msg.params
        out = {"prompt_embeds": self.encode(p.prompt)}
        if p.guidance_scale > 1.0:
            out["negative_prompt_embeds"] = self.encode(p.negative_prompt)
        timings = {**msg.timings, "encode_s": time.perf_counter() - t0}
        nxt = DenoiseRequest(
            v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p, timings=timings
        )
        return Forward("denoise", nxt, out)

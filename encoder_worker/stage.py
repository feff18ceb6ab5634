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


class EncoderStage(Stage):
    role = "encoder"

    def load(self) -> None:
        self.info = ModelInfo.read(self.config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.info.path / "tokenizer")
        self.text_encoder = UMT5EncoderModel.from_pretrained(
            self.info.path / "text_encoder", dtype=self.dtype
        ).to(self.device).eval()

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        """Embeddings [L, D] trimmed to the prompt's real token length."""
        tokens = self.tokenizer(
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
        hidden = self.text_encoder(tokens.input_ids.to(self.device), mask.to(self.device)).last_hidden_state
        return hidden[0, :length].to(self.text_encoder.dtype)

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

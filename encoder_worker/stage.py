"""Encoder stage: prompt cleaning, tokenization and the UMT5 text encoder."""

from __future__ import annotations

import collections
import html
import time

import regex
import torch
from transformers import AutoTokenizer, UMT5EncoderModel

from common.protocol.messages import PROTOCOL_VERSION, DenoiseRequest, EncodeRequest
from common.wan.model_info import MAX_SEQUENCE_LENGTH, ModelInfo
from common.runtime.stage import Forward, QueuedBatchStage

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
def encode_prompts(tokenizer, text_encoder, prompts: list[str]) -> list[torch.Tensor]:
    """Embeddings [L_i, D] for many prompts in one text-encoder call, each trimmed to its real length.

    Every prompt is padded to 512 tokens with its attention mask, exactly as
    diffusers' Wan pipeline does: all rows then have the same shape, so a
    prompt's embeddings are the same whatever else shares the call, and equal
    to what diffusers (or a trainer calling :func:`encode_prompt`) computes.
    """
    tokens = tokenizer(
        [clean_prompt(p) for p in prompts],
        padding="max_length",
        max_length=MAX_SEQUENCE_LENGTH,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = tokens.attention_mask
    lengths = mask.gt(0).sum(dim=1).tolist()
    device = text_encoder.device
    hidden = text_encoder(tokens.input_ids.to(device), mask.to(device)).last_hidden_state.to(text_encoder.dtype)
    return [hidden[i, :n] for i, n in enumerate(lengths)]


class EmbeddingCache:
    """Recently encoded prompts (the text encoder never changes while serving).

    RL groups repeat a prompt n times and most requests share a negative
    prompt; those then cost no text-encoder call. Bounded by bytes, least
    recently used first out.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.items: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    def get(self, text: str) -> torch.Tensor | None:
        hit = self.items.get(text)
        if hit is not None:
            self.items.move_to_end(text)
        return hit

    def put(self, text: str, embeds: torch.Tensor) -> None:
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or text in self.items:
            return
        self.items[text] = embeds
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()


def encode_prompt(tokenizer, text_encoder, prompt: str) -> torch.Tensor:
    """Embeddings [L, D] of one prompt (trainers use this to rebuild the engine's conditioning)."""
    return encode_prompts(tokenizer, text_encoder, [prompt])[0]


def load_text_encoder(model_dir, dtype: torch.dtype, device) -> tuple:
    info = ModelInfo.read(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(info.path / "tokenizer")
    text_encoder = UMT5EncoderModel.from_pretrained(info.path / "text_encoder", dtype=dtype)
    return tokenizer, text_encoder.to(device).eval().requires_grad_(False)


class EncoderStage(QueuedBatchStage):
    role = "encoder"

    def load(self) -> None:
        self.tokenizer, self.text_encoder = load_text_encoder(self.config.model, self.dtype, self.device)
        self.cache = EmbeddingCache(self.config.prompt_cache_bytes)

    def process_batch(self, items: list[tuple[EncodeRequest, dict]]) -> list[Forward]:
        """Every distinct prompt and negative prompt of the queued requests, in one encoder call
        for those not in the cache."""
        t0 = time.perf_counter()
        texts: set[str] = set()
        for msg, _ in items:
            texts.add(msg.params.prompt)
            if msg.params.guidance_scale > 1.0:
                texts.add(msg.params.negative_prompt)
        embeds = {t: self.cache.get(t) for t in sorted(texts)}
        missing = [t for t, e in embeds.items() if e is None]
        if missing:
            for text, emb in zip(missing, encode_prompts(self.tokenizer, self.text_encoder, missing)):
                embeds[text] = emb.clone()  # its own storage, not a view that pins the whole batch
                self.cache.put(text, embeds[text])
        elapsed = time.perf_counter() - t0
        out = []
        for msg, _ in items:
            p = msg.params
            tensors = {"prompt_embeds": embeds[p.prompt]}
            if p.guidance_scale > 1.0:
                tensors["negative_prompt_embeds"] = embeds[p.negative_prompt]
            timings = {**msg.timings, "encode_s": elapsed}
            nxt = DenoiseRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p,
                                 timings=timings)
            out.append(Forward("denoise", nxt, tensors))
        return out

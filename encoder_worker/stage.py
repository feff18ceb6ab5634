"""Encoder stage: the queued requests' prompts through the UMT5 text encoder, with a prompt cache."""

from __future__ import annotations

import time

from common.protocol.messages import NEGATIVE_PROMPT_EMBEDS, PROMPT_EMBEDS, PROTOCOL_VERSION, DenoiseRequest, EncodeRequest
from common.runtime.stage import Forward, QueuedBatchStage
from common.diffusion.policy import uses_guidance
from common.families.wan.text import WanTextEncoder
from encoder_worker.prompt_cache import EmbeddingCache


class EncoderStage(QueuedBatchStage):
    role = "encoder"

    def load(self) -> None:
        self.text_encoder = WanTextEncoder.load(self.config.model, self.dtype, self.device)
        self.cache = EmbeddingCache(self.config.prompt_cache_bytes)

    def process_batch(self, items: list[tuple[EncodeRequest, dict]]) -> list[Forward]:
        """Every distinct prompt and negative prompt of the queued requests, in one encoder call
        for those not in the cache."""
        t0 = time.perf_counter()
        texts: set[str] = set()
        for msg, _ in items:
            texts.add(msg.params.prompt)
            if uses_guidance(msg.params.guidance_scale):
                texts.add(msg.params.negative_prompt)
        embeds = {t: self.cache.get(t) for t in sorted(texts)}
        missing = [t for t, e in embeds.items() if e is None]
        if missing:
            for text, emb in zip(missing, self.text_encoder.encode(missing)):
                embeds[text] = emb.clone()  # its own storage, not a view that pins the whole batch
                self.cache.put(text, embeds[text])
        elapsed = time.perf_counter() - t0
        return [self._forward(msg, embeds, elapsed) for msg, _ in items]

    @staticmethod
    def _forward(msg: EncodeRequest, embeds: dict, elapsed: float) -> Forward:
        p = msg.params
        tensors = {PROMPT_EMBEDS.name: embeds[p.prompt]}
        if uses_guidance(p.guidance_scale):
            tensors[NEGATIVE_PROMPT_EMBEDS.name] = embeds[p.negative_prompt]
        nxt = DenoiseRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p,
                             timings={**msg.timings, "encode_s": elapsed})
        return Forward("denoise", nxt, tensors)

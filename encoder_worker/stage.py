"""Encoder stage: the queued requests' prompts through the family's text encoder(s), with a prompt cache."""

from __future__ import annotations

import time

from common.diffusion.policy import uses_guidance
from common.families import read_model
from common.protocol.messages import NEGATIVE_OF, PROTOCOL_VERSION, DenoiseRequest, EncodeRequest
from common.runtime.stage import Forward, QueuedBatchStage
from encoder_worker.prompt_cache import EmbeddingCache


class EncoderStage(QueuedBatchStage):
    role = "encoder"

    def load(self) -> None:
        info = read_model(self.config.model)
        self.family = info.family
        self.text_encoder = info.family.load_text_encoder(info, self.dtype, self.device)
        self.cache = EmbeddingCache(self.config.prompt_cache_bytes)

    def process_batch(self, items: list[tuple[EncodeRequest, dict]]) -> list[Forward]:
        """Every distinct prompt and negative prompt of the queued requests, in one encoder call per token
        budget (``max_sequence_length``) for those not in the cache."""
        t0 = time.perf_counter()
        texts: set[tuple[str, int]] = set()
        for msg, _ in items:
            p = msg.params
            texts.add((p.prompt, p.max_sequence_length))
            if uses_guidance(self.family.cfg_scale(p)):
                texts.add((p.negative_prompt, p.max_sequence_length))
        embeds = {t: self.cache.get(t) for t in sorted(texts)}
        for budget in sorted({length for (_, length), e in embeds.items() if e is None}):
            missing = [t for t, e in embeds.items() if e is None and t[1] == budget]
            for key, wire in zip(missing, self.text_encoder.wire_tensors([t for t, _ in missing], budget)):
                # Their own storage, not views that pin the whole batch.
                embeds[key] = {name: t.clone() for name, t in wire.items()}
                self.cache.put(key, embeds[key])
        elapsed = time.perf_counter() - t0
        return [self._forward(msg, embeds, elapsed, uses_guidance(self.family.cfg_scale(msg.params)))
                for msg, _ in items]

    @staticmethod
    def _forward(msg: EncodeRequest, embeds: dict, elapsed: float, guided: bool) -> Forward:
        p = msg.params
        tensors = dict(embeds[(p.prompt, p.max_sequence_length)])
        if guided:
            negative = embeds[(p.negative_prompt, p.max_sequence_length)]
            tensors.update({NEGATIVE_OF[name].name: t for name, t in negative.items()})
        nxt = DenoiseRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p,
                             timings={**msg.timings, "encode_s": elapsed})
        return Forward("denoise", nxt, tensors)

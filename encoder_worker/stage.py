"""Encoder stage: the queued requests' prompts through the family's text encoder(s), and their images through
its image side (image-to-video), with a cache of both.

The text encoder runs on ``--text-encoder-device`` when given (the host, for a GPU too small for it beside the
rest), in that device's default dtype unless ``--dtype`` says; the image side stays on the worker's device.
"""

from __future__ import annotations

import time

import torch

from common.config.engine import torch_dtype_for
from common.diffusion import text_roles
from common.diffusion.policy import uses_guidance
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.protocol.errors import RequestError
from common.protocol.images import image_digest, image_from_array
from common.protocol.messages import (
    IMAGE, INITIAL_LATENTS, LAST_IMAGE, NEGATIVE_OF, PROTOCOL_VERSION, DenoiseRequest, EncodeRequest,
)
from common.runtime.stage import Forward, QueuedBatchStage
from encoder_worker.prompt_cache import EmbeddingCache


class EncoderStage(QueuedBatchStage):
    role = "encoder"

    def load(self) -> None:
        info = read_model(self.config.model)
        self.family = info.family
        text_device = self.config.text_encoder_device or self.spec.device
        self.text_encoder = info.family.text.load_encoder(info, torch_dtype_for(text_device, self.config.dtype),
                                                          torch.device(text_device))
        self.images = None  # image-to-video models: the image encoder and the VAE's encoder half
        if info.family.condition.image_input(info) is not None:
            tiling = VaeTiling.of(self.config.vae_tiling, self.config.vae_tiling_pixels)
            self.images = info.family.condition.load(info, self.dtype, self.device, tiling)
        self.cache = EmbeddingCache(self.config.prompt_cache_bytes)
        self.memory = self.component_memory("text_encoder", {"text_encoder": self.text_encoder, "images": self.images})

    def process_batch(self, items: list[tuple[EncodeRequest, dict]]) -> list[Forward]:
        """Every distinct prompt and negative prompt of the queued requests, in one encoder call per token
        budget (``max_sequence_length``) for those not in the cache."""
        t0 = time.perf_counter()
        texts: set[tuple[str, int, bool]] = set()
        for msg, _ in items:
            p = msg.params
            texts.add(self._key(p.prompt, p.max_sequence_length, False))
            if uses_guidance(self.family.guidance.scale(p)):
                texts.add(self._key(p.negative_prompt, p.max_sequence_length, True))
        embeds = {t: self.cache.get(t) for t in sorted(texts)}
        for budget in sorted({length for (_, length, _), e in embeds.items() if e is None}):
            missing = [t for t, e in embeds.items() if e is None and t[1] == budget]
            wires = text_roles.encode(self.text_encoder, [(t, negative) for t, _, negative in missing], budget)
            for key, wire in zip(missing, wires):
                # Their own storage, not views that pin the whole batch.
                embeds[key] = {name: t.clone() for name, t in wire.items()}
                self.cache.put(key, embeds[key])
        elapsed = time.perf_counter() - t0
        out: list[Forward | BaseException] = []
        for msg, pixels in items:
            t1 = time.perf_counter()
            try:
                image = self._image_tensors(msg, pixels)
            except Exception as e:  # one request's image fails that request alone
                out.append(e)
                continue
            forward = self._forward(msg, embeds, elapsed, uses_guidance(self.family.guidance.scale(msg.params)), image,
                                    time.perf_counter() - t1)
            if INITIAL_LATENTS.name in pixels:  # a resumed rollout's starting latents ride on to the denoise worker
                forward.tensors[INITIAL_LATENTS.name] = pixels[INITIAL_LATENTS.name]
            out.append(forward)
        return out

    def _key(self, text: str, budget: int, negative: bool) -> tuple[str, int, bool]:
        """A text's cache key: its role counts only where the encoder encodes a negative prompt apart."""
        return text, budget, negative and text_roles.negative_apart(self.text_encoder)

    def _image_tensors(self, msg: EncodeRequest, pixels: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A request's image tensors for the denoise worker (none without an image), cached by the pixels and
        the request's size: a group, and a re-run, encode their image once."""
        if IMAGE.name not in pixels:
            return {}
        if self.images is None:  # the router refuses this first
            raise RequestError("image: this model takes no image")
        p = msg.params
        last = pixels.get(LAST_IMAGE.name)
        key = ("image", image_digest(pixels[IMAGE.name]), None if last is None else image_digest(last), p.height,
               p.width, p.num_frames)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.images.wire_tensors(image_from_array(pixels[IMAGE.name]),
                                           None if last is None else image_from_array(last),
                                           p.height, p.width, p.num_frames)
            hit = {name: t.clone() for name, t in hit.items()}
            self.cache.put(key, hit)
        return hit

    def _forward(self, msg: EncodeRequest, embeds: dict, elapsed: float, guided: bool, image: dict,
                 image_s: float) -> Forward:
        p = msg.params
        tensors = dict(embeds[self._key(p.prompt, p.max_sequence_length, False)])
        tensors.update(image)
        if guided:
            negative = embeds[self._key(p.negative_prompt, p.max_sequence_length, True)]
            tensors.update({NEGATIVE_OF[name].name: t for name, t in negative.items()})
        nxt = DenoiseRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p,
                             timings={**msg.timings, "encode_s": elapsed,
                                      **({"image_encode_s": image_s} if image else {})})
        return Forward("denoise", nxt, tensors)

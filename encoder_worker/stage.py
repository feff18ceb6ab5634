"""Encoder stage: the queued requests' prompts through the family's text encoder(s), and their images through
its image side (image-to-video, image editing), with a cache of both.

The text encoder runs on ``--text-encoder-device`` when given (the host, for a GPU too small for it beside the
rest), in that device's default dtype unless ``--dtype`` says; the image side stays on the worker's device.
"""

from __future__ import annotations

import time

import torch

from common.config.engine import torch_dtype_for
from common.diffusion import text_roles
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.protocol.errors import RequestError
from common.protocol.images import image_digest, image_from_array
from common.protocol.messages import (
    EDIT_IMAGES, INITIAL_LATENTS, LAST_IMAGE, PROTOCOL_VERSION, DenoiseRequest, EncodeRequest,
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
        budget (``max_sequence_length``) for those not in the cache. An encoder that sees images (image
        editing) encodes a text with its request's images: the images are part of the text's key."""
        t0 = time.perf_counter()
        digests = [self._digests(pixels) for _, pixels in items]  # each request's images, hashed once
        # What its texts key on (a request whose images are not pixels fails alone, below).
        seen = [d if self.family.condition.text_sees_images() and not isinstance(d, Exception) else ()
                for d in digests]
        by_digest = {d: pixels[f.name] for (_, pixels), ds in zip(items, seen)
                     for f, d in zip((f for f in EDIT_IMAGES if f.name in pixels), ds)}
        texts: set[tuple] = set()
        for (msg, _), images in zip(items, seen):
            p = msg.params
            texts.add(self._key(p.prompt, p.max_sequence_length, False, images))
            if self.family.guidance.uses_cfg(p):
                texts.add(self._key(p.negative_prompt, p.max_sequence_length, True, images))
        embeds = {t: self.cache.get(t) for t in sorted(texts)}
        for budget in sorted({key[1] for key, e in embeds.items() if e is None}):
            missing = [t for t, e in embeds.items() if e is None and t[1] == budget]
            pil = [[image_from_array(by_digest[d]) for d in key[3]] for key in missing] \
                if self.family.condition.text_sees_images() else None
            wires = text_roles.encode(self.text_encoder, [(key[0], key[2]) for key in missing], budget, pil)
            for key, wire in zip(missing, wires):
                # Their own storage, not views that pin the whole batch.
                embeds[key] = {name: t.clone() for name, t in wire.items()}
                self.cache.put(key, embeds[key])
        elapsed = time.perf_counter() - t0
        out: list[Forward | BaseException] = []
        for (msg, pixels), ds, images in zip(items, digests, seen):
            t1 = time.perf_counter()
            try:
                if isinstance(ds, Exception):
                    raise ds
                image = self._image_tensors(msg, pixels, ds)
            except Exception as e:  # one request's image fails that request alone
                out.append(e)
                continue
            forward = self._forward(msg, embeds, elapsed, self.family.guidance.uses_cfg(msg.params), image,
                                    time.perf_counter() - t1, images)
            if INITIAL_LATENTS.name in pixels:  # a resumed rollout's starting latents ride on to the denoise worker
                forward.tensors[INITIAL_LATENTS.name] = pixels[INITIAL_LATENTS.name]
            out.append(forward)
        return out

    @staticmethod
    def _digests(pixels: dict[str, torch.Tensor]) -> tuple[str, ...] | Exception:
        """The digests of a request's images (``image``, ``image.2``, ...), in order; the error of images
        that are not RGB pixels (that request's alone)."""
        try:
            return tuple(image_digest(pixels[f.name]) for f in EDIT_IMAGES if f.name in pixels)
        except ValueError as e:
            return e

    def _key(self, text: str, budget: int, negative: bool, images: tuple[str, ...] = ()) -> tuple:
        """A text's cache key: its role counts only where the encoder encodes a negative prompt apart; the
        images it is encoded with (their digests) where the encoder sees them."""
        return text, budget, negative and text_roles.negative_apart(self.text_encoder), images

    def _image_tensors(self, msg: EncodeRequest, pixels: dict[str, torch.Tensor],
                       digests: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """A request's image tensors for the denoise worker (none without an image), cached by the pixels
        (``digests``) and what of the request they depend on: a group, and a re-run, encode their images once."""
        if not digests:
            return {}
        if self.images is None:  # the router refuses this first
            raise RequestError("image: this model takes no image")
        condition, p = self.family.condition, msg.params
        last = pixels.get(LAST_IMAGE.name)
        key = ("image", digests, None if last is None else image_digest(last), condition.cache_key(p))
        hit = self.cache.get(key)
        if hit is None:
            given = [image_from_array(pixels[f.name]) for f in EDIT_IMAGES if f.name in pixels]
            hit = condition.wire_tensors(self.images, given, None if last is None else image_from_array(last), p)
            hit = {name: t.clone() for name, t in hit.items()}
            self.cache.put(key, hit)
        return hit

    def _forward(self, msg: EncodeRequest, embeds: dict, elapsed: float, guided: bool, image: dict,
                 image_s: float, seen: tuple[str, ...]) -> Forward:
        p = msg.params
        tensors = dict(embeds[self._key(p.prompt, p.max_sequence_length, False, seen)])
        tensors.update(image)
        if guided:
            negative = embeds[self._key(p.negative_prompt, p.max_sequence_length, True, seen)]
            twin = self.family.text.negatives()
            tensors.update({twin[name]: t for name, t in negative.items()})
        nxt = DenoiseRequest(v=PROTOCOL_VERSION, request_id=msg.request_id, route=msg.route, params=p,
                             timings={**msg.timings, "encode_s": elapsed,
                                      **({"image_encode_s": image_s} if image else {})})
        return Forward("denoise", nxt, tensors)
